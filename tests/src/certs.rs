//! Test certificates made with the `openssl` command: a CA and a server certificate it signs
//! (for a given DNS name), plus an unrelated CA that must not be trusted.

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

impl Certs {
    /// Makes the files in `dir` (created); the server certificate is for DNS name `host` only.
    pub fn create(dir: &Path, host: &str) -> Certs {
        std::fs::create_dir_all(dir).expect("certificate dir");
        self_signed_ca(dir, "ca");
        self_signed_ca(dir, "other-ca");
        openssl(
            dir,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                &format!("/CN={host}"),
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
            ],
        );
        std::fs::write(dir.join("san.ext"), format!("subjectAltName=DNS:{host}\n"))
            .expect("san.ext");
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "san.ext",
                "-out",
                "server.crt",
            ],
        );
        Certs {
            dir: dir.to_path_buf(),
            ca: dir.join("ca.crt"),
            other_ca: dir.join("other-ca.crt"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
        }
    }
}
