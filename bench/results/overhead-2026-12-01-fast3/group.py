import sys,re,subprocess,collections
f=sys.argv[1]
out=subprocess.run(["perf","report","-i",f,"--no-children","--sort","comm,dso,sym","-g","none","--stdio","--percent-limit","0"],capture_output=True,text=True).stdout
g=collections.Counter(); comm_tot=collections.Counter()
for line in out.splitlines():
    if line.startswith('#') or not line.strip(): continue
    m=re.match(r'\s*([\d.]+)%\s+(\S+)\s+(\S+)\s+\[(.)\]\s+(.*)',line)
    if not m: continue
    p,comm,dso,k,sym=m.groups(); p=float(p)
    comm_tot[comm]+=p
    if k=='k': grp='kernel'
    elif 'libc' in dso: grp='libc:'+('memmove/memcpy' if 'mem' in sym else sym.split('@')[0])
    elif sym.startswith('_mi_') or sym.startswith('mi_'): grp='mimalloc'
    else:
        s=sym.lstrip('<&').replace('mut ','').replace('dyn ','')
        c=s.split('::')[0]
        if c in('inferlb',):
            grp='inferlb::'+s.split('::')[1] if '::' in s else c
        else: grp=c
    if comm.startswith('inferlb-log'): grp='[log thread] '+('kernel' if k=='k' else 'user')
    g[grp]+=p
print(comm_tot)
for k,v in g.most_common(45): print(f"{v:6.2f} {k}")
