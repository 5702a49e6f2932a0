"""``agl-trainer ui``: a local web dashboard of runs, steps, groups, rollouts and token-level rows.

:mod:`.runs` reads run directories, :mod:`.traces` turns the Store's records into groups, rows and merge
breaks, :mod:`.server` serves the pages (templates in ``templates/``, uPlot and the page script in ``static/``).
"""
