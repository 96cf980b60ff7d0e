//! What braid's tests share across crates, so that no test target keeps its own copy:
//! - [`tools`]: the rule for a test that cannot run here (a missing tool or privilege): it says so,
//!   and under `BRAID_REQUIRE_TOOLS=1` (as CI runs) it fails instead;
//! - [`process`]: a child process's output for assertion messages, and the hex-and-marker lines two
//!   processes of a test talk in;
//! - with the `communicator` feature, [`ranks`] (ranks as threads of one process, each with its own
//!   communicator) and [`compression`] (the compressed all-reduce checks every rank runs, shared by
//!   the in-process tests and the multi-process harness).
#![forbid(unsafe_code)]

#[cfg(feature = "communicator")]
pub mod compression;
pub mod process;
#[cfg(feature = "communicator")]
pub mod ranks;
pub mod tools;
