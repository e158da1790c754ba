//! Data: the image processor (and, later, the chat format and MedPix reader).

pub mod chat;
pub mod image_processor;
pub mod resize;
