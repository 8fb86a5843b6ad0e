//! Certificates and keys for one control plane: a CA, the apiserver's serving certificate and
//! the service-account signing key.
use std::path::Path;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

use crate::{Error, Result};

/// File names written by [`write`], relative to the control plane's directory.
pub const CA_CERT: &str = "ca.crt";
pub const SERVING_CERT: &str = "apiserver.crt";
pub const SERVING_KEY: &str = "apiserver.key";
pub const SA_KEY: &str = "sa.key";
pub const SA_PUB: &str = "sa.pub";

fn err(e: rcgen::Error) -> Error {
    Error::Setup(format!("generating certificates: {e}"))
}

/// Writes the PKI into `dir` and returns the CA certificate PEM (for kubeconfig).
pub fn write(dir: &Path) -> Result<String> {
    let ca_key = KeyPair::generate().map_err(err)?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "opkit-testenv-ca");
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca_params.self_signed(&ca_key).map_err(err)?;
    let issuer = Issuer::new(ca_params, &ca_key);

    let serving_key = KeyPair::generate().map_err(err)?;
    let mut serving = CertificateParams::new(vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "kubernetes".to_string(),
        "kubernetes.default".to_string(),
        "kubernetes.default.svc".to_string(),
    ])
    .map_err(err)?;
    serving
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    let serving_cert = serving.signed_by(&serving_key, &issuer).map_err(err)?;

    let sa_key = KeyPair::generate().map_err(err)?;

    std::fs::write(dir.join(CA_CERT), ca_cert.pem())?;
    std::fs::write(dir.join(SERVING_CERT), serving_cert.pem())?;
    std::fs::write(dir.join(SERVING_KEY), serving_key.serialize_pem())?;
    std::fs::write(dir.join(SA_KEY), sa_key.serialize_pem())?;
    std::fs::write(dir.join(SA_PUB), sa_key.public_key_pem())?;
    Ok(ca_cert.pem())
}
