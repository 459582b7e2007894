//! The Kubernetes manifests under `deploy/kubernetes/` validate against the
//! API's schemas (`kubernetes-validate --strict`, from PyPI, installed by
//! `.ci/run` in the test virtual environment), a broken one is caught, and
//! the `ultrafast.toml` their ConfigMap carries passes `ultrafast check`
//! with the Secret's files in place.
#![allow(clippy::unwrap_used)]

mod common;
use std::path::{Path, PathBuf};
use std::process::Command;

fn manifests() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    v
}

fn validate(files: &[PathBuf]) -> std::process::Output {
    Command::new("kubernetes-validate")
        .arg("--strict")
        .args(files)
        .output()
        .expect(
            "kubernetes-validate (pip package kubernetes-validate; .ci/run installs it in .venv)",
        )
}

#[test]
fn the_manifests_validate_against_the_kubernetes_schemas() {
    let files = manifests();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in [
        "configmap.yaml",
        "deployment.yaml",
        "pdb.yaml",
        "redis.yaml",
        "secret.yaml",
        "service.yaml",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} missing: {names:?}");
    }
    let out = validate(&files);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    for kind in [
        "configmap/",
        "deployment/",
        "poddisruptionbudget/",
        "statefulset/",
        "secret/",
        "service/ultrafast",
    ] {
        assert!(text.contains(kind), "{kind} not validated: {text}");
    }
    // The validator is not a rubber stamp: a wrong type and an unknown
    // field are refused.
    let dir = common::scratch("k8s");
    let bad = dir.join("bad.yaml");
    let deploy =
        std::fs::read_to_string(&files[names.iter().position(|n| n == "deployment.yaml").unwrap()])
            .unwrap();
    std::fs::write(&bad, deploy.replace("replicas: 3", "replicas: three")).unwrap();
    assert!(!validate(std::slice::from_ref(&bad)).status.success());
    std::fs::write(
        &bad,
        deploy.replace("terminationGracePeriodSeconds", "terminationGraceSeconds"),
    )
    .unwrap();
    assert!(!validate(std::slice::from_ref(&bad)).status.success());
}

#[test]
fn the_configmaps_config_passes_ultrafast_check() {
    let dir = common::scratch("k8s-config");
    let cm = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/configmap.yaml");
    // PyYAML comes with kubernetes-validate.
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['data']['ultrafast.toml'])",
        ])
        .arg(&cm)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let toml = String::from_utf8(out.stdout).unwrap();
    // The Secret's files, as the pod mounts them.
    let (cert, key) = common::dev_certs(&dir.join("certs"));
    let secret = dir.join("secret");
    std::fs::create_dir_all(&secret).unwrap();
    std::fs::copy(cert, secret.join("tls.crt")).unwrap();
    std::fs::copy(key, secret.join("tls.key")).unwrap();
    std::fs::write(secret.join("ticket.keys"), "ab".repeat(32)).unwrap();
    std::fs::write(secret.join("admin-token"), "t".repeat(32)).unwrap();
    for f in ["ticket.keys", "admin-token", "tls.key"] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(secret.join(f), std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let conf = dir.join("ultrafast.toml");
    std::fs::write(
        &conf,
        toml.replace("/etc/ultrafast/secret", &secret.display().to_string()),
    )
    .unwrap();
    let out = Command::new(common::bin())
        .args(["check", "-c"])
        .arg(&conf)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
