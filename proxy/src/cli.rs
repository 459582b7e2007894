//! Helpers for subcommands that talk to a running instance.

use crate::config;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

/// `ultrafast reload`: ask the instance started from `path` to reload. Uses
/// `POST /admin/reload` when an admin listener is configured (and reports
/// the result), else sends SIGHUP to the pid in the pid file.
pub fn reload(path: &Path) -> Result<String, String> {
    let text = config::read(path).map_err(|e| {
        e.iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    })?;
    let file = config::parse_file(path, &text).map_err(|e| {
        e.iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    })?;
    let admin = file.admin.listen.trim();
    if !admin.is_empty() {
        let token = file
            .admin
            .resolve_token(path)
            .map_err(|(field, e)| format!("admin.{field}: {e}"))?;
        return post_reload(admin, token.as_deref());
    }
    let pid_file = if file.server.pid_file.is_empty() {
        config::default_runtime_path(path, "pid")
    } else {
        file.server.pid_file.clone()
    };
    let pid = std::fs::read_to_string(&pid_file)
        .map_err(|e| format!("{pid_file}: {e} (is ultrafast running with this config?)"))?;
    let pid = pid.trim();
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{pid_file}: not a pid: {pid:?}"));
    }
    let status = std::process::Command::new("kill")
        .args(["-HUP", pid])
        .status()
        .map_err(|e| format!("kill: {e}"))?;
    if status.success() {
        Ok(format!("sent SIGHUP to {pid}; see its log for the result"))
    } else {
        Err(format!("kill -HUP {pid} failed"))
    }
}

fn post_reload(admin: &str, token: Option<&str>) -> Result<String, String> {
    let mut s =
        std::net::TcpStream::connect(admin).map_err(|e| format!("admin listener {admin}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(|e| e.to_string())?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let req = format!("POST /admin/reload HTTP/1.1\r\nHost: {admin}\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(|e| e.to_string())?;
    let ok = out.starts_with("HTTP/1.1 200");
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    if ok {
        Ok(body.to_string())
    } else {
        Err(body.to_string())
    }
}
