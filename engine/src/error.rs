//! Engine errors: every failure names the file or the request field it is
//! about, and none is a panic.

use std::path::PathBuf;

/// What can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model file is missing, unreadable or not what it claims.
    #[error("{path}: {message}")]
    Model {
        /// The file.
        path: PathBuf,
        /// The problem.
        message: String,
    },
    /// Fetching the model failed.
    #[error("model fetch: {0}")]
    Fetch(String),
    /// The tokenizer or chat template could not be built or applied.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A tensor operation failed.
    #[error("compute: {0}")]
    Compute(#[from] candle_core::Error),
    /// The request cannot be served (too long, bad parameters).
    #[error("invalid request: {0}")]
    Invalid(String),
}

/// Engine results.
pub type Result<T> = std::result::Result<T, EngineError>;

impl EngineError {
    /// A model-file error.
    pub fn model(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        EngineError::Model {
            path: path.into(),
            message: message.into(),
        }
    }
}
