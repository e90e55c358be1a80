"""When each layer kernel starts and ends against the q/k/v projection's end (us, medians over the profiled
decode steps' layers): does the attention start early (dependent launch) and when does it end."""
import json, statistics, sys
events = sorted((e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"),
                key=lambda e: e["ts"])
model = [e for e in events if e["name"].startswith(("_gemv", "_decode", "cluster_decode"))]
rows = {"attention start": [], "attention end": [], "o start": [], "o end": []}
for i, e in enumerate(model[:-2]):
    if model[i + 1]["name"].startswith(("_decode", "cluster_decode")) and e["name"].startswith("_gemv"):
        qkv_end = e["ts"] + e["dur"]
        a, o = model[i + 1], model[i + 2]
        rows["attention start"].append(a["ts"] - qkv_end)
        rows["attention end"].append(a["ts"] + a["dur"] - qkv_end)
        rows["o start"].append(o["ts"] - qkv_end)
        rows["o end"].append(o["ts"] + o["dur"] - qkv_end)
print({k: round(statistics.median(v), 2) for k, v in rows.items() if v}, "layers:", len(rows["o end"]))
