//! Attribution: which layers are captured where ([`layers`]) and which rows of a step belong to
//! which request's prompt ([`plan`]).

pub mod layers;
pub mod plan;
