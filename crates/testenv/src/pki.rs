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
/// The real node's kubelet: its client identity (`system:node:<name>` in `system:nodes`).
pub const KUBELET_CERT: &str = "kubelet.crt";
pub const KUBELET_KEY: &str = "kubelet.key";
/// The apiserver's identity towards the kubelet (`kubectl logs`, `exec`).
pub const APISERVER_KUBELET_CERT: &str = "apiserver-kubelet-client.crt";
pub const APISERVER_KUBELET_KEY: &str = "apiserver-kubelet-client.key";

/// What a real node adds to the PKI.
pub struct NodeIdentity<'a> {
    /// The node's name (the kubelet's user is `system:node:<name>`).
    pub name: &'a str,
    /// The address Pods reach the apiserver on (a SAN of its serving certificate).
    pub ip: std::net::IpAddr,
}

fn err(e: rcgen::Error) -> Error {
    Error::Setup(format!("generating certificates: {e}"))
}

/// Writes the PKI into `dir` and returns the CA certificate PEM (for kubeconfig).
pub fn write(dir: &Path, node: Option<&NodeIdentity>) -> Result<String> {
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
    let mut names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        // The `kubernetes` Service's ClusterIP: what in-cluster clients dial.
        "10.96.0.1".to_string(),
        "kubernetes".to_string(),
        "kubernetes.default".to_string(),
        "kubernetes.default.svc".to_string(),
    ];
    if let Some(node) = node {
        names.push(node.ip.to_string());
    }
    let mut serving = CertificateParams::new(names).map_err(err)?;
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
    if let Some(node) = node {
        let client = |cn: &str, org: &str, cert: &str, key: &str| -> Result<()> {
            let k = KeyPair::generate().map_err(err)?;
            let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
            params.distinguished_name.push(DnType::CommonName, cn);
            params.distinguished_name.push(DnType::OrganizationName, org);
            params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
            let c = params.signed_by(&k, &issuer).map_err(err)?;
            std::fs::write(dir.join(cert), c.pem())?;
            std::fs::write(dir.join(key), k.serialize_pem())?;
            Ok(())
        };
        client(
            &format!("system:node:{}", node.name),
            "system:nodes",
            KUBELET_CERT,
            KUBELET_KEY,
        )?;
        client(
            "kube-apiserver-kubelet-client",
            "system:masters",
            APISERVER_KUBELET_CERT,
            APISERVER_KUBELET_KEY,
        )?;
    }
    Ok(ca_cert.pem())
}
