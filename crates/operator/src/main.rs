//! `opkit`: the operator binary of this repository (Memcached, At, Eru, Foo, PostgresDatabase), with opkit's
//! command line ([`opkit::cli`]) plus `--memcached-image` and `--postgres-poll-interval`, and the scaffolding commands that
//! start a new operator (`opkit init`, `opkit create api`, `opkit create webhook`).
use opkit_controllers::{Settings, memcached, operator};

/// glibc's malloc took over a third of the operator's CPU under load (decoding watch events
/// and building JSON bodies on every worker thread); jemalloc does the same work for about
/// an eighth less CPU in total at the same RSS (docs/benchmark.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The flags only this operator has.
#[derive(clap::Args)]
struct Flags {
    /// Image of the memcached containers.
    #[arg(long, default_value = memcached::DEFAULT_IMAGE)]
    memcached_image: String,
    /// How often the PostgreSQL servers of `PostgresDatabase`s are read, e.g. `30s`, `500ms`:
    /// drift made by hand is put right within it.
    #[arg(long, default_value = "30s", value_parser = duration)]
    postgres_poll_interval: std::time::Duration,
    /// The kinds whose objects get the labels their Namespace lists in
    /// `labels.opkit.dev/propagate`, comma-separated, as `kubectl` names resources:
    /// `deployments.v1.apps,configmaps.v1` (the core group has no suffix). They need not be
    /// installed yet: each is watched from when it is.
    #[arg(long, value_delimiter = ',')]
    label_propagation_resources: Vec<opkit::DynamicKind>,
}

/// `30s`, `500ms`, `2m` or plain seconds.
fn duration(s: &str) -> Result<std::time::Duration, String> {
    let (number, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a duration such as 30s or 500ms"))?;
    match unit {
        "" | "s" => Ok(std::time::Duration::from_secs(n)),
        "ms" => Ok(std::time::Duration::from_millis(n)),
        "m" => Ok(std::time::Duration::from_secs(n * 60)),
        _ => Err(format!("{s:?}: the unit must be ms, s or m")),
    }
}

fn main() -> anyhow::Result<()> {
    opkit::cli::main_with(
        operator(),
        |f: &Flags| Settings {
            memcached_image: f.memcached_image.clone(),
            postgres_poll: f.postgres_poll_interval,
            propagate: f.label_propagation_resources.clone(),
        },
        opkit_scaffold::run,
    )
}
