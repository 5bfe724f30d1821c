//! A capture session on one worker ([`session::Session`], the coordinator) and the parts it owns:
//! - [`protocol`]: the step protocol (attribution, the slots a step holds, the contract each capture meets);
//! - [`contract`]: the checks on every captured tensor, and the names of layer slots;
//! - [`slots`]: which slots a step holds (captured, received from another stage, absent);
//! - [`accounting`]: a captured step's checks, checksum and completed samples (worker thread);
//! - [`step_buffers`]: the step buffers (a ring of CPU arenas) and where rows are scattered;
//! - [`device_steps`]: device steps in flight behind a [`device::DeviceBackend`] ([`cuda`] on CUDA), [`host_pool`]:
//!   which pinned buffer, by size, a step's copies take, and [`stamps`]: what an armed step's stamps prove about its
//!   forward (CUDA graphs included);
//! - [`scatter`] and [`assembler`]: rows copied into per-request samples, inline or on a thread; [`refusals`]: the
//!   samples refused for degenerate states, each failing alone;
//! - [`stage_exchange`]: a step's rows sent to / received from another pipeline stage;
//! - [`arena`], [`rows`], [`tensor`]: a step's rows in host memory, and tensors from the caller.

pub mod accounting;
pub mod arena;
pub mod assembler;
pub mod contract;
pub mod cuda;
pub mod device;
pub mod device_steps;
pub mod host_pool;
pub mod protocol;
pub mod refusals;
pub mod rows;
pub mod scatter;
pub mod session;
pub mod slots;
pub mod stage_exchange;
pub mod stamps;
pub mod step;
pub mod step_buffers;
pub mod tensor;
