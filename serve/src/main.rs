//! `headway-serve`: run a target model — plain or speculative generation, Spec-Bench benchmarks
//! and their comparison, the OpenAI-compatible HTTP server and its load test.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use headway_serve::bench::{BenchArgs, CompareArgs};
use headway_serve::generate::GenerateArgs;
use headway_serve::http::load::LoadArgs;
use headway_serve::http::HttpArgs;

#[derive(Parser)]
#[command(
    name = "headway-serve",
    version,
    about = "Run a target model: generate text and benchmark decoding."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a reply to one prompt, streaming tokens to stdout, then print tokens, seconds and
    /// tokens/s on stderr.
    Generate(GenerateArgs),
    /// Measure a decoding method over Spec-Bench questions against plain decoding: τ, acceptance
    /// per depth, tokens/s and speedup, per category and overall.
    Bench(BenchArgs),
    /// Serve the target (with speculative decoding) behind an OpenAI-compatible HTTP API:
    /// /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.
    Http(HttpArgs),
    /// A bounded load run against a running server: latency and time-to-first-token
    /// percentiles, tokens/s and errors.
    Load(LoadArgs),
    /// List the prompts whose outputs differ between two `bench --json` reports (a losslessness
    /// check: greedy speculative decoding must match `ar` exactly). Exits 1 if any differ.
    Compare(CompareArgs),
}

fn main() -> ExitCode {
    headway_model::allocator::return_large_buffers();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().command {
        Command::Generate(args) => headway_serve::generate::run(args),
        Command::Bench(args) => headway_serve::bench::run(args),
        Command::Compare(args) => headway_serve::bench::compare(args),
        Command::Http(args) => headway_serve::http::run(args),
        Command::Load(args) => headway_serve::http::load::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
