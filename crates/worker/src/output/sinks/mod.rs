//! Where encoded samples go: the [`sink::Sink`] interface and its file sink (a capture directory, each file
//! journaled), [`staging`]'s per-request files for a client that collects them (under held locks, swept by
//! [`janitor`]), [`store`]'s objects in an object store (Mooncake), packed as [`packed`] says; [`writer`]: the
//! threads that feed a sink behind a bounded queue; [`failed`]: a server's samples that failed their requests
//! alone; [`dirlock`]: one writing process per output directory.

pub mod dirlock;
pub mod failed;
pub mod janitor;
pub mod packed;
pub mod sink;
pub mod staging;
pub mod store;
pub mod writer;
