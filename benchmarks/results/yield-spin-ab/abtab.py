import json,sys
pre=sys.argv[1] if len(sys.argv)>1 else "cb"
rounds=sys.argv[2].split(",") if len(sys.argv)>2 else ["1","2"]
for op in ("allreduce","allgather","reducescatter"):
    rows={}
    for cfg in ("base","new"):
        for rnd in rounds:
            try: d=json.load(open(f"{pre}_{op}_{cfg}_{rnd}.json"))
            except FileNotFoundError: continue
            for r in d["rows"]:
                rows.setdefault(r["size"],{}).setdefault(cfg,[]).append(round(r["time_us"]))
    print(op, "time us: base rounds | new rounds")
    for size,v in sorted(rows.items()):
        print(f"  {size:>9} {str(v.get('base')):>22} | {v.get('new')}")
