//! Errors of the model forward for inputs the caller supplied (ids, masks, images): each
//! names the input at fault.

/// Errors raised by the model forward for inputs the caller supplied.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// An input tensor or argument is inconsistent (shapes, ids, images).
    #[error("input `{name}`: {message}")]
    Input {
        /// The input's name.
        name: String,
        /// What is wrong with it.
        message: String,
    },
}
