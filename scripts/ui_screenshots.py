"""The dashboard screenshots in README.md and docs/dashboard.md, made again: python scripts/ui_screenshots.py [OUT_DIR].

Records the browser tests' run through a real gateway (tests/ui_records.py: a stand-in engine), gives it eight
made-up metrics lines (so the curves have points; the numbers are illustrative, not a training run), serves
the dashboard and photographs three pages with Debian's chromium (scripts/setup-browser.sh).
"""
import asyncio, json, sys, tempfile, uuid, math, random
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "images"
from fakes import Served
from ui_records import char_upstream, record_run, decode, EOS, step_line
from agl_gateway import GatewaySettings, create_app as gw_app
from agl_common.store import Store
from agl_trainer.ui.server import create_app
from agl_trainer.ui.traces import Decoder
from playwright.sync_api import sync_playwright
R="redis://127.0.0.1:6379/15"; P=f"shots-{uuid.uuid4().hex[:6]}:"
tmp = Path(tempfile.mkdtemp()); run_id = "1201-061500-demo"
async def rec():
    store = Store(R, P)
    with Served(char_upstream()) as up, Served(gw_app(GatewaySettings(upstream=up.url+"/v1", redis_url=R, prefix=P, model="agent", heartbeat_s=0.2))) as gw:
        d = await record_run(store, gw.url, tmp, run_id)
    await store.close(); return d
d = asyncio.run(rec())
random.seed(1)
lines = [{"eval": "before", "accuracy": 0.05, "n": 40, "failed": 0}]
for s in range(1, 9):
    m = step_line(s, list(d["groups"]) if s == 1 else [])
    m.update(reward_mean=0.1 + 0.04*s + random.uniform(-.04,.04), accuracy=0.08+0.035*s+random.uniform(-.03,.03), loss=0.2*math.exp(-s/4)+random.uniform(-.02,.02),
             kl=0.002*s, ratio_mean=1+random.uniform(-.01,.01), clip_frac=0.01*random.random(), rows=30+random.randint(-3,3), merge_breaks=random.randint(0,3), failed=random.randint(0,2),
             time_generation_s=40+random.uniform(-5,5), time_wait_s=3+random.random(), time_update_s=12+random.random(), time_weight_load_s=2+random.random(), time_pause_drain_s=0.5+random.random(), step_s=60+random.uniform(-5,5))
    lines.append(m)
lines.append({"eval": "after", "accuracy": 0.125, "n": 40, "failed": 0})
(d["run_dir"] / "metrics.jsonl").write_text("".join(json.dumps(m)+"\n" for m in lines))
(d["run_dir"] / "summary.json").write_text(json.dumps({"heldout_before": 0.05, "heldout_after": 0.125, "heldout_n": 40, "steps": 8}))
gid = list(d["groups"])[0]; rid = d["groups"][gid][1]
with Served(create_app(R, P, tmp, Decoder(decode, {EOS}))) as ui, sync_playwright() as pw:
    b = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless","--no-sandbox","--disable-gpu","--disable-quic","--no-first-run","--disable-background-networking","--disable-component-update","--disable-sync"])
    p = b.new_page(viewport={"width": 1180, "height": 760})
    p.goto(f"{ui.url}/runs/{run_id}"); p.wait_for_selector("#charts canvas"); p.wait_for_timeout(300)
    p.screenshot(path=str(OUT / "ui-run.png"))
    p.goto(f"{ui.url}/runs/{run_id}/steps/1"); p.screenshot(path=str(OUT / "ui-step.png"))
    p.goto(f"{ui.url}/runs/{run_id}/steps/1/groups/{gid}/rollouts/{rid}/rows/1"); p.screenshot(path=str(OUT / "ui-row.png"))
    b.close()
import redis as _r
_c = _r.Redis.from_url(R)
_k = list(_c.scan_iter(match=P + "*"))
if _k:
    _c.delete(*_k)
print("screenshots in", OUT)
