//! `headway-train`: see the library ([`headway_train`]) for the commands.

use std::process::ExitCode;

use clap::Parser;
use headway_train::{run, Cli, Hooks};

fn main() -> ExitCode {
    headway_model::allocator::return_large_buffers();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse(), &Hooks::default()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
