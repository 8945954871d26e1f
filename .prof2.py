import time
from concurrent.futures import ThreadPoolExecutor
from shardkit.dev.devserver import DevServer
from shardkit.packing.sources.objects import Objects
with DevServer(key_prefix="sk") as s3:
    so = s3.storage_options(); fs = s3.filesystem(); fs.mkdir("bkt-prof")
    t=time.time(); fs.pipe({f"bkt-prof/o/{i:04d}": b"x"*2000 for i in range(300)}); print("put300", time.time()-t)
    ob = Objects(so)
    urls=[f"s3://bkt-prof/o/{i:04d}" for i in range(300)]
    t=time.time(); [ob.read(u, 3000) for u in urls[:100]]; print("seq100", time.time()-t)
    with ThreadPoolExecutor(16) as p:
        t=time.time(); list(p.map(lambda u: ob.read(u, 3000), urls[100:300])); print("par200", time.time()-t)
    t=time.time(); fs.cat(urls[:200]); print("fs.cat200", time.time()-t)
