//! A capture directory read back: [`verify`] checks every file against its record and the contract; [`resume`]
//! decides which files a re-run keeps.

pub mod resume;
pub mod verify;
