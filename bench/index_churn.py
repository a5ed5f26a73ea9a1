"""One server's index under churn: a pod that stores new blocks and loses old ones, as an engine
whose cache is full does. Server CPU per block, in each layout (``kvindex/redis.py``).

A throwaway Valkey server (``bench/cluster.py``'s ``Servers``, on ``--base-port``). Per case: one
pod is filled with ``--blocks`` aligned chained blocks (16-block stores), then ``--steps`` steps
each store 16 new blocks and remove 16 live ones, picked at random. Reported per step's block (one
stored and one removed): the server's CPU (``INFO cpu``, user + sys) and its script time
(``INFO commandstats``, ``EVALSHA``). (Memory per entry: ``bench/cluster.py``.) The cases
(``--layouts``) run interleaved ``--repeats`` times; the medians are printed.

``--tree DIR`` imports the index from another checkout (e.g. the commit before a layout change),
which knows only the default layout.

    .venv/bin/python bench/index_churn.py [--layouts fast,compact] [--blocks 20000]
        [--steps 600] [--repeats 3] [--tree DIR] [--base-port 17260] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layouts", default="fast,compact")
    parser.add_argument("--blocks", type=int, default=20_000, help="live blocks of the pod")
    parser.add_argument("--steps", type=int, default=600, help="16 stored and 16 removed each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tree", default=None, help="import the index from this checkout")
    parser.add_argument("--base-port", type=int, default=17260)
    parser.add_argument("--out", default=str(ROOT / "var" / "bench" / "index_churn.json"))
    return parser.parse_args()


ARGS = parse_args()
sys.path.insert(0, str(ROOT))
if ARGS.tree:
    sys.path.insert(0, str(Path(ARGS.tree).resolve()))

from bench.cluster import Servers  # noqa: E402
from bench.machine import machine  # noqa: E402
from kvindex import open_index  # noqa: E402
from kvindex.base import StoredBlock  # noqa: E402
from kvindex.keys import chain_digests, key_of, root_digest  # noqa: E402

BATCH = 16


def run_case(servers: Servers, layout: str, blocks: list[StoredBlock], seed: int) -> dict:
    """Fill, churn, and measure one layout on a flushed server."""
    servers.flush()
    options = {} if layout == "fast" else {"layout": layout}
    index = open_index(servers.url, socket_timeout=10, **options)
    live = ARGS.blocks
    for start in range(0, live, BATCH):
        index.store(model="bench/model", pod="pod-000", tier="gpu", blocks=blocks[start : start + BATCH])
    rng = random.Random(seed)
    held = list(range(live))
    client = servers.clients[0]
    client.config_resetstat()
    cpu = client.info("cpu")
    before = cpu["used_cpu_user"] + cpu["used_cpu_sys"]
    for step in range(ARGS.steps):
        new = range(live + step * BATCH, live + (step + 1) * BATCH)
        index.store(model="bench/model", pod="pod-000", tier="gpu", blocks=[blocks[i] for i in new])
        held += new
        gone = [held.pop(rng.randrange(len(held))) for _ in range(BATCH)]
        index.remove(
            model="bench/model",
            pod="pod-000",
            tier="gpu",
            engine_hashes=[blocks[i].engine_hash for i in gone],
        )
    cpu = client.info("cpu")
    used = cpu["used_cpu_user"] + cpu["used_cpu_sys"] - before
    scripts = client.info("commandstats")["cmdstat_evalsha"]["usec"]
    per_block = ARGS.steps * BATCH
    index.close()
    return {
        "layout": layout,
        "server_cpu_us": round(used * 1e6 / per_block, 2),
        "script_us": round(scripts / per_block, 2),
    }


def main() -> None:
    total = ARGS.blocks + ARGS.steps * BATCH
    digests = chain_digests(range(BATCH * total), block_size=BATCH, parent=root_digest("42"))
    blocks = [StoredBlock(key=key_of(d), engine_hash=key_of(d), digest=d) for d in digests]
    layouts = ARGS.layouts.split(",")
    servers = Servers("redis", ARGS.base_port)
    runs: dict[str, list[dict]] = {layout: [] for layout in layouts}
    try:
        for repeat in range(ARGS.repeats):  # interleaved, so that the host's noise hits them alike
            for layout in layouts:
                run = run_case(servers, layout, blocks, seed=repeat)
                runs[layout].append(run)
                print(f"  {layout}: {run}")
    finally:
        servers.stop()
    results = {"machine": machine(), "params": vars(ARGS), "cases": []}
    for layout, case_runs in runs.items():
        case = {
            "layout": layout,
            "server_cpu_us": statistics.median(r["server_cpu_us"] for r in case_runs),
            "script_us": statistics.median(r["script_us"] for r in case_runs),
            "runs": case_runs,
        }
        results["cases"].append(case)
        print(
            f"{layout:8s} per block stored and removed: server CPU {case['server_cpu_us']} us, "
            f"scripts {case['script_us']} us"
        )
    out = Path(ARGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
