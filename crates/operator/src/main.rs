//! `opkit`: the operator binary of this repository (Memcached, At, Eru, Foo), with opkit's
//! command line ([`opkit::cli`]) plus `--memcached-image`, and the scaffolding commands that
//! start a new operator (`opkit init`, `opkit create api`, `opkit create webhook`).
use opkit_controllers::{Settings, memcached, operator};

/// The flags only this operator has.
#[derive(clap::Args)]
struct Flags {
    /// Image of the memcached containers.
    #[arg(long, default_value = memcached::DEFAULT_IMAGE)]
    memcached_image: String,
}

fn main() -> anyhow::Result<()> {
    opkit::cli::main_with(
        operator(),
        |f: &Flags| Settings {
            memcached_image: f.memcached_image.clone(),
        },
        opkit_scaffold::run,
    )
}
