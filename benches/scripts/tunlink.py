"""A link between two network namespaces with delay and loss, in user
space, for kernels without `sch_netem` (tc netem): one TUN device in each
namespace, and a thread here that moves IP packets between them, each
delayed by `delay_s` and dropped with probability `loss` (independently,
as netem's `loss P%`), in order per direction. The TUN devices are made in
this process's namespace and then moved; their descriptors stay ours.

    link = TunLink("ufb-srv", "10.213.0.1", "ufb-cli", "10.213.0.2", 0.025, 0.01)
    ...
    link.stop()
"""
import fcntl, heapq, os, random, select, struct, subprocess, threading, time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def _tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def _ip(*args):
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class TunLink:
    def __init__(self, ns_a, addr_a, ns_b, addr_b, delay_s, loss, seed=46):
        self.delay, self.loss = delay_s, loss
        self.rng = random.Random(seed)
        self.fa, self.fb = _tun("uftun-a"), _tun("uftun-b")
        for dev, ns, mine, peer in [("uftun-a", ns_a, addr_a, addr_b), ("uftun-b", ns_b, addr_b, addr_a)]:
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", mine, "peer", peer, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        self.sent = self.dropped = 0
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        queue, seq = [], 0
        other = {self.fa: self.fb, self.fb: self.fa}
        while self.running:
            now = time.monotonic()
            while queue and queue[0][0] <= now:
                _, _, fd, pkt = heapq.heappop(queue)
                try:
                    os.write(fd, pkt)
                    self.sent += 1
                except OSError:
                    pass
            wait = max(0.0, queue[0][0] - now) if queue else 0.05
            ready, _, _ = select.select([self.fa, self.fb], [], [], min(wait, 0.05))
            for fd in ready:
                while True:
                    try:
                        pkt = os.read(fd, 65535)
                    except BlockingIOError:
                        break
                    except OSError:
                        break
                    if self.rng.random() < self.loss:
                        self.dropped += 1
                        continue
                    seq += 1
                    heapq.heappush(queue, (time.monotonic() + self.delay, seq, other[fd], pkt))

    def stop(self):
        self.running = False
        self.thread.join(timeout=2)
        for fd in (self.fa, self.fb):
            try:
                os.close(fd)
            except OSError:
                pass
