//! Test certificates made with the `openssl` command: a CA, a server certificate it signs (for a
//! given DNS name) and a client certificate for the user `postgres`, plus an unrelated CA that
//! must not be trusted.

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct Certs {
    pub dir: PathBuf,
    /// The CA that signed the server certificate.
    pub ca: PathBuf,
    /// A CA that signed nothing here.
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// Client certificate (CN=postgres) and key, signed by `ca`.
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl must be installed");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn self_signed_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
        ],
    );
}

/// `name.key` and `name.crt` for common name `cn`, signed by `ca`, with `ext` as extensions.
fn signed(dir: &Path, name: &str, cn: &str, ext: Option<&str>) {
    let (key, csr, crt) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.crt"),
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            &format!("/CN={cn}"),
            "-keyout",
            &key,
            "-out",
            &csr,
        ],
    );
    let mut args = vec![
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        &crt,
    ];
    let ext_file = format!("{name}.ext");
    if let Some(ext) = ext {
        std::fs::write(dir.join(&ext_file), ext).expect("extensions file");
        args.extend(["-extfile", &ext_file]);
    }
    openssl(dir, &args);
}

impl Certs {
    /// Makes the files in `dir` (created); the server certificate is for DNS name `host` only.
    pub fn create(dir: &Path, host: &str) -> Certs {
        std::fs::create_dir_all(dir).expect("certificate dir");
        self_signed_ca(dir, "ca");
        self_signed_ca(dir, "other-ca");
        signed(
            dir,
            "server",
            host,
            Some(&format!("subjectAltName=DNS:{host}\n")),
        );
        signed(dir, "client", "postgres", None);
        Certs {
            dir: dir.to_path_buf(),
            ca: dir.join("ca.crt"),
            other_ca: dir.join("other-ca.crt"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.crt"),
            client_key: dir.join("client.key"),
        }
    }
}
