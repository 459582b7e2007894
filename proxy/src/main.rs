//! The `ultrafast` command line.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(all(feature = "jemalloc", not(feature = "mimalloc")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[cfg(feature = "mimalloc")]
/// `mi_option_purge_delay` in mimalloc's option enum (index 15 in both the
/// bundled v3, the default, and v2).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// mimalloc hands freed pages back to the OS `purge_delay` (10 ms) after
/// they are freed, but only when the thread that freed them calls the
/// allocator again: worker threads that go idle after a burst (an overload
/// shed, a flood of connections) kept its memory for ever (+9 MiB RSS after
/// a 60 s soak at 3x capacity). Purging at once gives it back within a
/// second; proxy throughput did not move measurably (wrk, 3 rounds).
#[cfg(feature = "mimalloc")]
#[allow(unsafe_code)]
fn return_freed_memory_promptly() {
    // SAFETY: `mi_option_set` stores one integer in mimalloc's option table;
    // it is called once, first thing in `main`, and the option is one
    // mimalloc documents as settable at run time.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) }
}

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
    /// Model tools.
    Models {
        #[command(subcommand)]
        cmd: ModelsCmd,
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
enum ModelsCmd {
    /// Fetch a known model into the cache (sha256-verified) and print its path.
    Pull {
        /// Model name (`smollm2-135m-instruct`).
        #[arg(default_value = "smollm2-135m-instruct")]
        name: String,
    },
    /// List known models and whether they are cached.
    List,
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

fn models(cmd: ModelsCmd) -> ExitCode {
    use ultrafast_engine::fetch;
    match cmd {
        ModelsCmd::List => {
            println!("cache: {}", fetch::cache_dir().display());
            for m in fetch::KNOWN {
                let state = fetch::cached(m)
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "not cached".into());
                println!("{}\t{}\t{state}", m.name, m.requirements());
            }
            ExitCode::SUCCESS
        }
        ModelsCmd::Pull { name } => {
            let Some(src) = fetch::known(&name) else {
                let names: Vec<&str> = fetch::KNOWN.iter().map(|m| m.name).collect();
                eprintln!(
                    "ultrafast: unknown model `{name}` (known: {})",
                    names.join(", ")
                );
                return ExitCode::FAILURE;
            };
            match fetch::pull(src) {
                Ok(p) => {
                    println!("{}", p.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("ultrafast: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn main() -> ExitCode {
    #[cfg(feature = "mimalloc")]
    return_freed_memory_promptly();
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
        Cmd::Models { cmd } => models(cmd),
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
            match ultrafast::runtime::load(&config, &metrics) {
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
