#!/bin/bash
# Profile ultrafast under wrk load with perf (cpu-clock sampling; this VM
# has no hardware counters). Needs nginx, wrk, linux-perf; loopback only,
# bounded (5 s), stops what it starts. Build first: cargo build --release -p ultrafast
set -e
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
fp() { python3 -c "import socket;s=socket.socket();s.bind((\"127.0.0.1\",0));print(s.getsockname()[1])"; }
OP=$(fp); UP=$(fp)
D=$(mktemp -d)
cat > $D/origin.conf <<EOC
daemon off; pid $D/o.pid; error_log $D/o.err warn; user root; worker_processes 1; events {} http { access_log off; server { listen 127.0.0.1:$OP; location / { return 200 'hello world\n'; } } }
EOC
nginx -p $D -c $D/origin.conf & O=$!
cat > $D/uf.toml <<EOC
[server]
threads = 1
pid_file = "$D/uf.pid"
upgrade_sock = "$D/uf.sock"
shutdown_grace_period_s = 0
[admin]
listen = ""
[log]
access_log = "off"
[[listeners]]
address = "127.0.0.1:$UP"
[pools.o]
members = [{ addr = "127.0.0.1:$OP" }]
[[routes]]
path = "/"
pool = "o"
EOC
RUST_LOG=warn $ROOT/target/release/ultrafast serve -c $D/uf.toml & U=$!
sleep 1
wrk -t1 -c64 -d2s http://127.0.0.1:$UP/ > /dev/null
perf record -F 2000 -g -p $U -o $D/perf.data -- sleep 5 > /dev/null 2>&1 &
wrk -t1 -c64 -d5s http://127.0.0.1:$UP/ | grep Requests
sleep 1
perf report -i $D/perf.data --no-children --sort symbol --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -60
kill $U $O; wait 2>/dev/null
rm -rf $D
