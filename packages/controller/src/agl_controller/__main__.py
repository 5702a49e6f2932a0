from .cli import main

if __name__ == "__main__":  # a multiprocessing *spawn* child imports this module as __mp_main__: no CLI there
    main()
