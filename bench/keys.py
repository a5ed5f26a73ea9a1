"""Block-key cost: cbor2 against the hand-written encoder, per 16-token block.

Run from anywhere: ``.venv/bin/python bench/keys.py [--out var/bench/keys.json]``.

Three ways to get the digest of one block, each chained from the previous block's digest:

* ``cbor2``   - ``sha256(cbor2.dumps([parent, tokens, extra], canonical=True))``, the reference;
* ``fast``    - ``kvindex.keys.block_digest`` (hand-written canonical CBOR + sha256);
* ``chain``   - ``kvindex.keys.chain_digests`` over a whole prompt of ``--blocks`` blocks, divided
  by the number of blocks (what ingest and scoring actually call).

The machine is noisy, so every figure is the median over ``--repeats`` rounds, and in each round
all variants run back to back; the ratio cbor2/fast is taken within each round, then its median.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import cbor2  # noqa: E402

from bench.machine import machine  # noqa: E402
from kvindex.keys import block_digest, chain_digests, root_digest  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 151_936  # Qwen2/Qwen3 vocabulary size
SEED = "42"
LORA = ("Alice",)


def cbor2_chain(blocks: list[list[int]], parent: bytes, extra: tuple | None) -> bytes:
    extra_obj = list(extra) if extra is not None else None
    sha256, dumps = hashlib.sha256, cbor2.dumps
    prev = parent
    for block in blocks:
        prev = sha256(dumps([prev, block, extra_obj], canonical=True)).digest()
    return prev


def fast_chain(blocks: list[list[int]], parent: bytes, extra: tuple | None) -> bytes:
    prev = parent
    for block in blocks:
        prev = block_digest(prev, block, extra)
    return prev


def whole_chain(tokens: list[int], parent: bytes, extra: tuple | None) -> bytes:
    return chain_digests(tokens, block_size=BLOCK_SIZE, parent=parent, extra=extra)[-1]


def time_us_per_block(fn: Callable[[], object], n_blocks: int, min_seconds: float) -> float:
    """Microseconds per block of one timed run of ``fn`` (repeated until ``min_seconds`` elapse)."""
    calls = 0
    gc.disable()
    try:
        start = time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
    finally:
        gc.enable()
    return elapsed / (calls * n_blocks) * 1e6


def run(*, n_blocks: int, repeats: int, min_seconds: float) -> list[dict]:
    rng = random.Random(20240917)
    tokens = [rng.randrange(VOCAB) for _ in range(n_blocks * BLOCK_SIZE)]
    blocks = [tokens[i : i + BLOCK_SIZE] for i in range(0, len(tokens), BLOCK_SIZE)]
    root = root_digest(SEED)

    rows = []
    for label, extra in (("none", None), ("lora", LORA)):
        variants: dict[str, Callable[[], bytes]] = {
            "cbor2": lambda extra=extra: cbor2_chain(blocks, root, extra),
            "fast": lambda extra=extra: fast_chain(blocks, root, extra),
            "chain": lambda extra=extra: whole_chain(tokens, root, extra),
        }
        last = {name: fn() for name, fn in variants.items()}
        if len(set(last.values())) != 1:
            raise SystemExit(f"variants disagree on the last digest (extra={label}): {last}")

        samples: dict[str, list[float]] = {name: [] for name in variants}
        ratios: list[float] = []
        for _ in range(repeats):
            for name, fn in variants.items():
                samples[name].append(time_us_per_block(fn, n_blocks, min_seconds))
            ratios.append(samples["cbor2"][-1] / samples["fast"][-1])
        rows.append(
            {
                "extra": label,
                "us_per_block": {name: statistics.median(s) for name, s in samples.items()},
                "us_per_block_min": {name: min(s) for name, s in samples.items()},
                "us_per_block_max": {name: max(s) for name, s in samples.items()},
                "ratio_cbor2_over_fast": statistics.median(ratios),
                "ratio_cbor2_over_chain": statistics.median(
                    c / w for c, w in zip(samples["cbor2"], samples["chain"], strict=True)
                ),
            }
        )
    return rows


def print_table(rows: list[dict], info: dict) -> None:
    m = info["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores")
    print(f"python:  {m['python']} ({m['platform']}), cbor2 {m['cbor2']}")
    print(f"date:    {info['date']}")
    p = info["params"]
    print(
        f"blocks of {p['block_size']} token ids in 0..{p['vocab'] - 1}, {p['blocks']} blocks per call, "
        f"median of {p['repeats']} rounds (min..max in brackets)\n"
    )
    columns = ("cbor2+sha256", "block_digest", "chain_digests")
    head = (
        f"{'extra':<6} " + " ".join(f"{c:>22}" for c in columns) + f" {'cbor2/fast':>11} {'cbor2/chain':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = [
            f"{r['us_per_block'][n]:.3f} [{r['us_per_block_min'][n]:.2f}..{r['us_per_block_max'][n]:.2f}]"
            for n in ("cbor2", "fast", "chain")
        ]
        print(
            f"{r['extra']:<6} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22} "
            f"{r['ratio_cbor2_over_fast']:>10.2f}x {r['ratio_cbor2_over_chain']:>11.2f}x"
        )
    print("\n(us per block key; extra 'lora' = ('Alice',) on every block)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "var" / "bench" / "keys.json")
    parser.add_argument("--blocks", type=int, default=512, help="blocks per timed call")
    parser.add_argument("--repeats", type=int, default=21, help="rounds; every figure is their median")
    parser.add_argument("--min-seconds", type=float, default=0.02, help="minimum duration of one sample")
    args = parser.parse_args(argv)

    info = {
        "benchmark": "block keys",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(cbor2=metadata.version("cbor2")),
        "params": {
            "block_size": BLOCK_SIZE,
            "vocab": VOCAB,
            "blocks": args.blocks,
            "repeats": args.repeats,
            "min_seconds": args.min_seconds,
            "seed": SEED,
            "lora_extra": list(LORA),
        },
    }
    info["results"] = run(n_blocks=args.blocks, repeats=args.repeats, min_seconds=args.min_seconds)
    print_table(info["results"], info)

    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info, indent=2) + "\n")
    print(f"results written to {out}")


if __name__ == "__main__":
    main()
