import psutil, time, json, sys
# sample CPU seconds of every peer's processes by role, until no peer is left
out = sys.argv[1]
seen = {}
t0 = time.time()
def role(p):
    name = p.name()
    if name == 'p2pd': return 'p2pd'
    try:
        par = p.parent()
        if par and 'client.cli' in ' '.join(par.cmdline()):
            kids = [c for c in p.children() if c.name() == 'p2pd']
            return 'dht' if kids else 'averager'
    except Exception: pass
    return 'trainer'
started = False
while True:
    procs = [p for p in psutil.process_iter(['cmdline','name']) if p.info['name']=='p2pd' or 'client.cli' in ' '.join(p.info['cmdline'] or [])]
    if procs: started = True
    elif started: break
    for p in procs:
        try:
            c = p.cpu_times(); seen[p.pid] = dict(role=role(p), cpu=c.user+c.system, t=time.time())
        except Exception: pass
    if time.time() - t0 > 900: break
    time.sleep(1)
agg = {}
for v in seen.values(): agg[v['role']] = agg.get(v['role'],0)+v['cpu']
json.dump(dict(by_role=agg, wall=time.time()-t0), open(out,'w'), indent=1)
print(agg, time.time()-t0)
