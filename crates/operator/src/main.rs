//! `opkit`: the operator binary of this repository (Memcached, At, Eru, Foo). Its command line
//! is opkit's own ([`opkit::cli`]) plus `--memcached-image`.
use opkit_controllers::{Settings, memcached, operator};

/// The flags only this operator has.
#[derive(clap::Args)]
struct Flags {
    /// Image of the memcached containers.
    #[arg(long, default_value = memcached::DEFAULT_IMAGE)]
    memcached_image: String,
}

fn main() -> anyhow::Result<()> {
    opkit::cli::main(operator(), |f: &Flags| Settings {
        memcached_image: f.memcached_image.clone(),
    })
}
