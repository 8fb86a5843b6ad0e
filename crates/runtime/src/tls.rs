//! The certificate of the operator's HTTPS servers (admission webhooks, metrics): where it
//! comes from and how it is reloaded; [`crate::https`] serves connections with it.
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_util::sync::CancellationToken;

/// How long a generated serving certificate is valid.
pub(crate) const VALIDITY: k8s_openapi::jiff::SignedDuration =
    k8s_openapi::jiff::SignedDuration::from_hours(365 * 24);

/// A serving certificate: PEM chain and key.
#[derive(Clone)]
pub struct Certificate {
    /// The certificate chain, PEM.
    pub cert_pem: String,
    /// Its private key, PEM.
    pub key_pem: String,
    /// The CA that signed it, for the configurations' `caBundle`.
    pub ca_pem: String,
}

/// Makes a CA and a serving certificate for `hosts` (DNS names or IP addresses), valid a year.
pub fn self_signed(hosts: &[String]) -> Result<Certificate, rcgen::Error> {
    let not_after = k8s_openapi::jiff::Timestamp::now()
        .checked_add(VALIDITY)
        .map_err(|_| rcgen::Error::Time)?;
    self_signed_until(hosts, not_after)
}

/// Makes a CA and a serving certificate for `hosts`, both valid from yesterday until the day
/// of `not_after`.
pub fn self_signed_until(
    hosts: &[String],
    not_after: k8s_openapi::jiff::Timestamp,
) -> Result<Certificate, rcgen::Error> {
    use k8s_openapi::jiff::tz::TimeZone;
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let day = |t: k8s_openapi::jiff::Timestamp| {
        let d = t.to_zoned(TimeZone::UTC).date();
        rcgen::date_time_ymd(i32::from(d.year()), d.month() as u8, d.day() as u8)
    };
    let yesterday = k8s_openapi::jiff::Timestamp::now()
        .checked_sub(k8s_openapi::jiff::SignedDuration::from_hours(24))
        .map_err(|_| rcgen::Error::Time)?;
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name.push(DnType::CommonName, "opkit-webhook-ca");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = day(yesterday);
    ca.not_after = day(not_after);
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = KeyPair::generate()?;
    let mut leaf = CertificateParams::new(hosts.to_vec())?;
    leaf.distinguished_name.push(DnType::CommonName, "opkit-webhook");
    leaf.not_before = day(yesterday);
    leaf.not_after = day(not_after);
    let cert = leaf.signed_by(&key, &issuer)?;
    Ok(Certificate {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        ca_pem: ca_cert.pem(),
    })
}

/// Where the serving certificate comes from.
#[derive(Clone)]
pub enum CertSource {
    /// Made in memory at start.
    Generated(Certificate),
    /// `tls.crt` and `tls.key` in a directory (a cert-manager Secret mount), reloaded when they
    /// change, so a renewed certificate is served without a restart.
    Dir(PathBuf),
    /// The latest certificate and key (PEM) sent on the channel, e.g. from the shared Secret.
    Watch(tokio::sync::watch::Receiver<(String, String)>),
}

pub(crate) fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("reading the certificate: {e}"))?;
    if chain.is_empty() {
        return Err("no certificate in the PEM".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("reading the key: {e}"))?;
    let key =
        rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| format!("unsupported key: {e}"))?;
    let ck = CertifiedKey::new(chain, key);
    // Half-written files (a certificate renewed, its key not yet) must not be served.
    match ck.keys_match() {
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            Err("the key does not match the certificate".into())
        }
        _ => Ok(ck),
    }
}

#[derive(Debug)]
struct Resolver(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

fn read_dir_cert(dir: &Path) -> Result<(CertifiedKey, SystemTime), String> {
    let (c, k) = (dir.join("tls.crt"), dir.join("tls.key"));
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display()));
    let mtime = |p: &Path| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH)
    };
    Ok((certified_key(&read(&c)?, &read(&k)?)?, mtime(&c).max(mtime(&k))))
}

/// A TLS acceptor serving the certificate of `certs`, kept current until `shutdown`: a mounted
/// directory is re-read every 10 s, a watched certificate whenever it is sent. `h2` also
/// offers HTTP/2.
pub(crate) fn acceptor(
    certs: &CertSource,
    h2: bool,
    what: &'static str,
    shutdown: &CancellationToken,
) -> Result<tokio_rustls::TlsAcceptor, String> {
    let (initial, dir) = match certs {
        CertSource::Generated(c) => (certified_key(c.cert_pem.as_bytes(), c.key_pem.as_bytes())?, None),
        CertSource::Dir(d) => {
            let (k, t) = read_dir_cert(d)?;
            (k, Some((d.clone(), t)))
        }
        CertSource::Watch(rx) => {
            let (c, k) = rx.borrow().clone();
            (certified_key(c.as_bytes(), k.as_bytes())?, None)
        }
    };
    let resolver = Arc::new(Resolver(RwLock::new(Arc::new(initial))));
    if let CertSource::Watch(rx) = certs {
        let (mut rx, resolver, shutdown) = (rx.clone(), resolver.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    changed = rx.changed() => if changed.is_err() { return },
                }
                let (c, k) = rx.borrow_and_update().clone();
                match certified_key(c.as_bytes(), k.as_bytes()) {
                    Ok(ck) => {
                        *resolver.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(ck);
                        tracing::info!(server = what, "serving the renewed certificate");
                    }
                    Err(e) => tracing::warn!(server = what, error = %e, "certificate not reloaded"),
                }
            }
        });
    }
    if let Some((dir, mut seen)) = dir {
        let (resolver, shutdown) = (resolver.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(10)) => {}
                }
                match read_dir_cert(&dir) {
                    Ok((k, t)) if t > seen => {
                        *resolver.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(k);
                        seen = t;
                        tracing::info!(server = what, dir = %dir.display(), "reloaded the certificate");
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(server = what, error = %e, "certificate not reloaded"),
                }
            }
        });
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = match h2 {
        true => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        false => vec![b"http/1.1".to_vec()],
    };
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
