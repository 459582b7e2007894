//! The `ultrafast` command line.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// ultrafast: an edge proxy that replaces nginx and fronts LLM inference.
#[derive(Parser, Debug)]
#[command(name = "ultrafast", version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the server.
    Serve {
        /// Configuration file.
        #[arg(short, long, default_value = "conf/ultrafast.toml")]
        config: PathBuf,
        /// Take over the listening sockets of a running instance (graceful
        /// upgrade: start the new binary with this flag, then send SIGQUIT to
        /// the old one).
        #[arg(short, long)]
        upgrade: bool,
    },
    /// Reload the running instance's configuration (through its admin
    /// listener, else SIGHUP to the pid in its pid file).
    Reload {
        /// Configuration file of the running instance.
        #[arg(short, long, default_value = "conf/ultrafast.toml")]
        config: PathBuf,
    },
    /// Certificate tools.
    Certs {
        #[command(subcommand)]
        cmd: CertsCmd,
    },
    /// Validate a configuration file and print every problem (like `nginx -t`).
    Check {
        /// Configuration file.
        #[arg(short, long, default_value = "conf/ultrafast.toml")]
        config: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum CertsCmd {
    /// Create a throwaway local CA and a certificate for localhost,
    /// 127.0.0.1 and ::1 (ca.pem, localhost.pem, localhost.key).
    Dev {
        /// Output directory.
        #[arg(long, default_value = "certs/dev")]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    match cli.cmd {
        Cmd::Serve { config, upgrade } => {
            match ultrafast::server::serve(&config, ultrafast::server::ServeOptions { upgrade }) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("ultrafast: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Cmd::Reload { config } => match ultrafast::cli::reload(&config) {
            Ok(msg) => {
                println!("{msg}");
                ExitCode::SUCCESS
            }
            Err(msg) => {
                eprintln!("{msg}");
                ExitCode::FAILURE
            }
        },
        Cmd::Certs {
            cmd: CertsCmd::Dev { out },
        } => match ultrafast::edge::devcerts::write(&out) {
            Ok(files) => {
                for f in files {
                    println!("wrote {}", f.display());
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("ultrafast: {e}");
                ExitCode::FAILURE
            }
        },
        Cmd::Check { config } => {
            let metrics = ultrafast::metrics::Metrics::new();
            match ultrafast::config::load(&config, &metrics) {
                Ok(_) => {
                    println!("{}: configuration is ok", config.display());
                    ExitCode::SUCCESS
                }
                Err(errs) => {
                    for e in &errs {
                        eprintln!("{e}");
                    }
                    eprintln!("{}: {} error(s)", config.display(), errs.len());
                    ExitCode::FAILURE
                }
            }
        }
    }
}
