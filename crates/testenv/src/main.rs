//! `opkit-testenv`: build, start and stop the local control plane from the command line.
fn main() -> anyhow::Result<()> {
    opkit_testenv::cli::main()
}
