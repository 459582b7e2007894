//! A real `redis-server`, started and stopped by PID on a loopback port,
//! for the tests of `[cluster]` (shared limits, jobs, ACME orders).

use super::*;

/// A `redis-server` child on a fixed loopback port.
pub struct Redis {
    child: Option<Child>,
    pub port: u16,
    dir: std::path::PathBuf,
}

pub fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut b = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut b).is_ok() && &b == b"+PONG\r\n"
}

impl Redis {
    pub fn start() -> Redis {
        let mut r = Redis {
            child: None,
            port: free_port(),
            dir: scratch("redis"),
        };
        r.resume();
        r
    }

    /// (Re)start on the same port, with nothing persisted.
    pub fn resume(&mut self) {
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (Debian package redis-server; .ci/run installs it)");
        self.child = Some(child);
        assert!(
            eventually(Duration::from_secs(10), || ping(self.port)),
            "redis-server did not start"
        );
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stop (SIGSTOP) or continue (SIGCONT) the server by PID: unreachable
    /// while stopped, with its data when it continues.
    pub fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().unwrap().id().to_string();
        assert!(Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.signal("-CONT");
        }
        self.stop();
    }
}
