"""The builds A/B's table: per op and size, each round's time for both builds and the ratio of
their medians.  python3 cmp.py DIR  (DIR as builds.sh wrote it)"""
import glob
import json
import statistics as st
import sys

d = sys.argv[1]


def load(f):
    return {(r["op"], r["size"]): r["neuron"]["time_us"] for r in json.load(open(f))["rows"]}


for mode in ("loop", "one"):
    runs = {b: [load(f) for f in sorted(glob.glob(f"{d}/{b}_{mode}_*.json"))] for b in ("base", "new")}
    print(f"## {mode}: us per call, rounds base | new, ratio of medians new/base")
    for k in runs["base"][0]:
        b, n = [r[k] for r in runs["base"]], [r[k] for r in runs["new"]]
        print(f"{k[0]:>15} {k[1]:>7}  " + " ".join(f"{x:6.1f}" for x in b) + " | " + " ".join(f"{x:6.1f}" for x in n)
              + f"  {st.median(n) / st.median(b):5.2f}x  new<base {sum(x < y for x, y in zip(n, b))}/{len(n)}")
