//! What crosses ranks: the tensor-parallel checksum comparison ([`checksums`]), the ranks' agreement at each
//! meeting ([`meeting`]), how a layer's rows on one rank relate to the step ([`row_layout`]), and one pipeline
//! stage's rows as a message for the stage that assembles ([`stage_message`]).

pub mod checksums;
pub mod meeting;
pub mod row_layout;
pub mod stage_message;
