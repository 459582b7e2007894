//! A real nginx for the differential tests, started and stopped here by PID
//! (`.ci/run` installs Debian's package).

use super::{free_port, scratch};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running nginx; killed when dropped.
pub struct Nginx {
    child: Child,
    /// Its listening address.
    pub addr: SocketAddr,
    /// Its prefix directory (config, logs, temporary files).
    pub dir: PathBuf,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start nginx with `http` inside its `http { }` block, where `{port}`
/// names the port it is to listen on and `{dir}` its directory.
pub fn start(tag: &str, http: &str) -> Nginx {
    let dir = scratch(tag);
    let port = free_port();
    let d = dir.display().to_string();
    let http = http
        .replace("{port}", &port.to_string())
        .replace("{dir}", &d);
    let conf = format!(
        "daemon off; master_process off; worker_processes 1; pid {d}/nginx.pid; error_log {d}/error.log;\n\
         user root;\n\
         events {{ worker_connections 64; }}\n\
         http {{ access_log off; client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d};\n\
         uwsgi_temp_path {d}; scgi_temp_path {d};\n{http}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    let child = Command::new("nginx")
        .args(["-e", "stderr", "-p"])
        .arg(&dir)
        .arg("-c")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nginx is not installed: `bash .ci/run` installs it (Debian package nginx)");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(addr).is_err() {
        assert!(
            Instant::now() < end,
            "nginx did not start: {}",
            std::fs::read_to_string(dir.join("error.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Nginx { child, addr, dir }
}
