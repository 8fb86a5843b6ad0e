//! Whether a password is the one a role's stored verifier was made from, checked as the
//! server checks a login (RFC 5802 / RFC 7677 for SCRAM-SHA-256): drift of a password set
//! by hand shows in the catalog without logging in, and without the server ever receiving
//! the password itself.
use base64::Engine;
use base64::engine::general_purpose::STANDARD;

/// The most SCRAM iterations a verifier may ask for (PostgreSQL makes 4096 by default).
const MAX_ITERATIONS: u32 = 100_000;

/// Whether `password` matches `verifier` (`SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`
/// or `md5<hex>`) of `role`. No verifier, or one that cannot be read, does not match.
pub fn matches(verifier: Option<&str>, password: &str, role: &str) -> bool {
    match verifier {
        Some(v) if v.starts_with("SCRAM-SHA-256$") => scram(v, password).unwrap_or(false),
        Some(v) if v.starts_with("md5") => v == postgres_protocol::password::md5(password.as_bytes(), role),
        _ => false,
    }
}

fn scram(verifier: &str, password: &str) -> Option<bool> {
    let rest = verifier.strip_prefix("SCRAM-SHA-256$")?;
    let (params, keys) = rest.split_once('$')?;
    let (iterations, salt) = params.split_once(':')?;
    let (stored, _server) = keys.split_once(':')?;
    // A role may set its own password, so the count is the role's to choose: more than a
    // server would make counts as drift (put back), never as minutes of hashing in a plan.
    let iterations: u32 = iterations.parse().ok()?;
    if iterations > MAX_ITERATIONS {
        return None;
    }
    let iterations = std::num::NonZeroU32::new(iterations)?;
    let salt = STANDARD.decode(salt).ok()?;
    let stored = STANDARD.decode(stored).ok()?;
    // The server prepares the password as libpq does: SASLprep when it applies.
    let prepared = match stringprep::saslprep(password) {
        Ok(p) => p.into_owned().into_bytes(),
        Err(_) => password.as_bytes().to_vec(),
    };
    let mut salted = [0u8; 32];
    ring::pbkdf2::derive(
        ring::pbkdf2::PBKDF2_HMAC_SHA256,
        iterations,
        &salt,
        &prepared,
        &mut salted,
    );
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &salted);
    let client_key = ring::hmac::sign(&key, b"Client Key");
    let stored_key = ring::digest::digest(&ring::digest::SHA256, client_key.as_ref());
    Some(stored_key.as_ref() == stored.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verifier_made_from_a_password_matches_it_and_no_other() {
        let v = postgres_protocol::password::scram_sha_256(b"s3cret");
        assert!(matches(Some(&v), "s3cret", "app"));
        assert!(!matches(Some(&v), "s3cret!", "app"));
        let md5 = postgres_protocol::password::md5(b"s3cret", "app");
        assert!(matches(Some(&md5), "s3cret", "app"));
        assert!(
            !matches(Some(&md5), "s3cret", "other"),
            "md5 is salted with the role"
        );
        assert!(!matches(None, "s3cret", "app"));
        assert!(!matches(Some("SCRAM-SHA-256$x:y$z"), "s3cret", "app"));
        assert!(!matches(
            Some("SCRAM-SHA-256$0:c2FsdA==$YQ==:YQ=="),
            "s3cret",
            "app"
        ));
    }
}
