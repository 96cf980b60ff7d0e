//! Runtime configuration from `BRAID_*` environment variables.
//!
//! Every variable is optional; a value that does not parse is an error naming the variable, never a
//! silent fallback, because a mistyped tuning knob that is ignored costs hours.

use std::time::Duration;

use crate::Error;

/// Log verbosity (`BRAID_DEBUG`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DebugLevel {
    /// Errors only (the default).
    Error,
    /// `BRAID_DEBUG=warn`.
    Warn,
    /// `BRAID_DEBUG=info`.
    Info,
    /// `BRAID_DEBUG=debug`.
    Debug,
    /// `BRAID_DEBUG=trace`.
    Trace,
}

impl DebugLevel {
    /// The `tracing` filter directive for this level.
    pub fn directive(self) -> &'static str {
        match self {
            // Security warnings (a derived bootstrap secret) are shown even at the quietest level.
            DebugLevel::Error => "error,braid::security=warn",
            DebugLevel::Warn => "warn",
            DebugLevel::Info => "info",
            DebugLevel::Debug => "debug",
            DebugLevel::Trace => "trace",
        }
    }
}

/// Tunables of a communicator. [`Config::default`] holds the built-in defaults; [`Config::from_env`]
/// applies the environment on top of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Deadline of every wait (`BRAID_TIMEOUT_MS`, default 300000).
    pub timeout: Duration,
    /// Bytes per transport slot, the pipelining unit (`BRAID_CHUNK_BYTES`, default 131072).
    pub chunk_bytes: usize,
    /// Slots per channel, how far a sender may run ahead (`BRAID_SLOTS`, default 8; a power of two).
    pub slots: usize,
    /// Rings a ring all-reduce is split over, alternating direction (`BRAID_CHANNELS`, default 1).
    pub channels: usize,
    /// Streams of a communicator: each has its own channel on every link and its own order
    /// (`BRAID_STREAMS`, default 2, at most 8).
    pub streams: usize,
    /// How long a wait spins before it blocks, in microseconds (`BRAID_SPIN_US`; default: 20 when there
    /// are at least as many cores as local ranks, 0 when ranks outnumber cores).
    pub spin_us: Option<u64>,
    /// Algorithm policy from `BRAID_ALGO` (e.g. `all_reduce:tree;all_gather:^direct`); `None` lets braid
    /// choose.
    pub algo: Option<String>,
    /// Tuning file written by `braid tune` (`BRAID_TUNE_FILE`).
    pub tune_file: Option<std::path::PathBuf>,
    /// Where each rank writes its timeline of collectives and markers, Chrome trace-event JSON
    /// (`BRAID_TIMELINE`; `{rank}` in it becomes the rank, else `.rank<r>` goes before the extension).
    /// `None`: no timeline.
    pub timeline: Option<std::path::PathBuf>,
    /// Largest all-reduce (bytes) sent with the one-step direct algorithm when braid chooses
    /// (`BRAID_DIRECT_MAX_BYTES`, default 16384).
    pub direct_max_bytes: usize,
    /// Largest gradient bucket of `braid::GradientBuckets`, in bytes (`BRAID_BUCKET_BYTES`, default
    /// 26214400, 25 MiB, as PyTorch DDP's); a parameter larger than this gets a bucket of its own.
    pub bucket_bytes: usize,
    /// Log verbosity (`BRAID_DEBUG`).
    pub debug: DebugLevel,
    /// Compare every collective's fingerprint across ranks before running it (`BRAID_DEBUG_CHECKS`).
    pub debug_checks: bool,
    /// Log the flight recorder (the last collectives) when a collective fails (`BRAID_DUMP_ON_TIMEOUT`,
    /// default on).
    pub dump_on_timeout: bool,
    /// Which transports may connect ranks, in order of preference (`BRAID_TRANSPORT`: `auto`, or a
    /// comma-separated list such as `tcp` or `shm,tcp`; default `auto`). braid-transport checks the names.
    pub transport: String,
    /// TCP connections per pair of ranks and direction; each message is split across them
    /// (`BRAID_SOCKETS_PER_PEER`, default 1).
    pub sockets_per_peer: usize,
    /// Interfaces TCP may use: comma-separated name prefixes, `^` excludes (`BRAID_SOCKET_IFNAME`, e.g.
    /// `eth,^docker`). Default: the interface that routes to the bootstrap root.
    pub socket_ifname: Option<String>,
    /// This rank's host identity, overriding detection (`BRAID_HOST_ID`). Ranks with equal identities
    /// are on one host.
    pub host_id: Option<String>,
    /// A topology file that says which ranks share a host (`BRAID_TOPO_FILE`); it shapes the
    /// algorithms, while identities still decide which peers can use shared memory.
    pub topo_file: Option<std::path::PathBuf>,
    /// Infer which ranks share a host by measuring latency and bandwidth between every pair at start-up
    /// (`BRAID_TOPO_PROBE`), for clouds where host identities do not tell.
    pub topo_probe: bool,
    /// Rank 0 writes the topology in use to this file, in the `BRAID_TOPO_FILE` format
    /// (`BRAID_TOPO_DUMP_FILE`).
    pub topo_dump_file: Option<std::path::PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_millis(300_000),
            chunk_bytes: 128 * 1024,
            slots: 8,
            channels: 1,
            streams: 2,
            spin_us: None,
            algo: None,
            tune_file: None,
            timeline: None,
            direct_max_bytes: 16 * 1024,
            bucket_bytes: 25 << 20,
            debug: DebugLevel::Error,
            debug_checks: false,
            dump_on_timeout: true,
            transport: "auto".into(),
            sockets_per_peer: 1,
            socket_ifname: None,
            host_id: None,
            topo_file: None,
            topo_probe: false,
            topo_dump_file: None,
        }
    }
}

/// Parses a boolean environment value (`1/0`, `true/false`, `yes/no`, `on/off`).
pub fn parse_bool(name: &str, value: &str) -> Result<bool, Error> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        _ => Err(Error::invalid(format!(
            "{name}={value:?} is not a boolean (use 1 or 0)"
        ))),
    }
}

/// The range of one numeric setting: its environment variable's parser and the check of a value set
/// in code ([`Config::check`], and the transports' own settings) both apply it, so the two cannot
/// disagree.
#[derive(Clone, Copy, Debug)]
pub struct Limit {
    /// The environment variable.
    var: &'static str,
    /// The `Config` field, as a user writes it.
    field: &'static str,
    min: u64,
    max: u64,
}

impl Limit {
    /// The limit of variable `var`, set in code as `field`, to `min..=max`.
    pub const fn new(var: &'static str, field: &'static str, min: u64, max: u64) -> Limit {
        Limit {
            var,
            field,
            min,
            max,
        }
    }

    /// The environment variable.
    pub fn var(&self) -> &'static str {
        self.var
    }

    /// The smallest value allowed.
    pub fn min(&self) -> u64 {
        self.min
    }

    /// The largest value allowed.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The variable's `value`, parsed and in range.
    pub fn parse(&self, value: &str) -> Result<u64, Error> {
        let v: u64 = value.trim().parse().map_err(|_| {
            Error::invalid(format!(
                "{}={value:?} is not a non-negative integer",
                self.var
            ))
        })?;
        if !self.contains(u128::from(v)) {
            return Err(Error::invalid(format!(
                "{}={v} is out of range {}..={}",
                self.var, self.min, self.max
            )));
        }
        Ok(v)
    }

    /// Whether `v` is in range.
    fn contains(&self, v: u128) -> bool {
        (u128::from(self.min)..=u128::from(self.max)).contains(&v)
    }

    /// Whether the field's value `v` is in range.
    pub fn check(&self, v: u64) -> Result<(), Error> {
        if !self.contains(u128::from(v)) {
            return Err(Error::invalid(format!(
                "config: {} = {v} is out of range {}..={} (the range of {})",
                self.field, self.min, self.max, self.var
            )));
        }
        Ok(())
    }
}

const fn limit(var: &'static str, field: &'static str, min: u64, max: u64) -> Limit {
    Limit::new(var, field, min, max)
}

const TIMEOUT_MS: Limit = limit("BRAID_TIMEOUT_MS", "timeout (in ms)", 1, 86_400_000);
const CHUNK_BYTES: Limit = limit("BRAID_CHUNK_BYTES", "chunk_bytes", 64, 64 << 20);
const SLOTS: Limit = limit("BRAID_SLOTS", "slots", 2, 64);
const STREAMS: Limit = limit("BRAID_STREAMS", "streams", 1, 8);
const CHANNELS: Limit = limit("BRAID_CHANNELS", "channels", 1, 16);
const SPIN_US: Limit = limit("BRAID_SPIN_US", "spin_us", 0, 10_000_000);
const DIRECT_MAX_BYTES: Limit = limit("BRAID_DIRECT_MAX_BYTES", "direct_max_bytes", 0, 64 << 20);
const BUCKET_BYTES: Limit = limit("BRAID_BUCKET_BYTES", "bucket_bytes", 1, 1 << 40);
const SOCKETS_PER_PEER: Limit = limit("BRAID_SOCKETS_PER_PEER", "sockets_per_peer", 1, 16);
impl Config {
    /// Every environment variable [`Config::from_env`] reads. [`Config::from_lookup`] asks for nothing
    /// else (a name missing here fails its debug assertion, and a unit test checks that it asks for
    /// each of these), and the environment page of the docs (`docs/src/environment.md`) must document
    /// every one (`tests/environment_docs.rs`).
    pub const VARIABLES: &'static [&'static str] = &[
        "BRAID_TIMEOUT_MS",
        "BRAID_CHUNK_BYTES",
        "BRAID_SLOTS",
        "BRAID_STREAMS",
        "BRAID_CHANNELS",
        "BRAID_SPIN_US",
        "BRAID_ALGO",
        "BRAID_TIMELINE",
        "BRAID_TUNE_FILE",
        "BRAID_DIRECT_MAX_BYTES",
        "BRAID_BUCKET_BYTES",
        "BRAID_DEBUG_CHECKS",
        "BRAID_DUMP_ON_TIMEOUT",
        "BRAID_TRANSPORT",
        "BRAID_SOCKETS_PER_PEER",
        "BRAID_SOCKET_IFNAME",
        "BRAID_HOST_ID",
        "BRAID_TOPO_FILE",
        "BRAID_TOPO_PROBE",
        "BRAID_TOPO_DUMP_FILE",
        "BRAID_DEBUG",
    ];

    /// Why a channel cannot have `slots` slots (`None`: it can). A message's slot is its 32-bit
    /// counter modulo the slot count, so the count must divide 2^32: a power of two, at least 2.
    pub fn slots_refused(slots: usize) -> Option<String> {
        (slots < 2 || !slots.is_power_of_two()).then(|| {
            format!(
                "{slots} slots per channel: the count must be a power of two of at least 2 (a \
                 message's slot is its 32-bit counter modulo the count, which must divide 2^32)"
            )
        })
    }

    /// Whether every numeric setting is in the range its environment variable allows (the same
    /// ranges), and the slot count a power of two. `Communicator::init` checks a `Config` built in code
    /// with this before anything starts. The error is an invalid argument naming the field, its value
    /// and the range.
    pub fn check(&self) -> Result<(), Error> {
        if !TIMEOUT_MS.contains(self.timeout.as_millis()) {
            return Err(Error::invalid(format!(
                "config: timeout = {:?} is out of range {} ms..={} ms (the range of {})",
                self.timeout, TIMEOUT_MS.min, TIMEOUT_MS.max, TIMEOUT_MS.var
            )));
        }
        CHUNK_BYTES.check(self.chunk_bytes as u64)?;
        SLOTS.check(self.slots as u64)?;
        if let Some(why) = Config::slots_refused(self.slots) {
            return Err(Error::invalid(format!("config: slots: {why}")));
        }
        STREAMS.check(self.streams as u64)?;
        CHANNELS.check(self.channels as u64)?;
        if let Some(us) = self.spin_us {
            SPIN_US.check(us)?;
        }
        DIRECT_MAX_BYTES.check(self.direct_max_bytes as u64)?;
        BUCKET_BYTES.check(self.bucket_bytes as u64)?;
        SOCKETS_PER_PEER.check(self.sockets_per_peer as u64)?;
        Ok(())
    }

    /// The defaults overridden by the process environment.
    pub fn from_env() -> Result<Config, Error> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    /// The defaults overridden by `lookup` (a stand-in for the environment, used by tests).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config, Error> {
        let lookup = |name: &str| {
            debug_assert!(
                Config::VARIABLES.contains(&name),
                "{name} is read but missing from Config::VARIABLES"
            );
            lookup(name)
        };
        let mut c = Config::default();
        if let Some(v) = lookup("BRAID_TIMEOUT_MS") {
            c.timeout = Duration::from_millis(TIMEOUT_MS.parse(&v)?);
        }
        if let Some(v) = lookup("BRAID_CHUNK_BYTES") {
            c.chunk_bytes = CHUNK_BYTES.parse(&v)? as usize;
        }
        if let Some(v) = lookup("BRAID_SLOTS") {
            c.slots = SLOTS.parse(&v)? as usize;
            if let Some(why) = Config::slots_refused(c.slots) {
                return Err(Error::invalid(format!("BRAID_SLOTS={v}: {why}")));
            }
        }
        if let Some(v) = lookup("BRAID_STREAMS") {
            c.streams = STREAMS.parse(&v)? as usize;
        }
        if let Some(v) = lookup("BRAID_CHANNELS") {
            c.channels = CHANNELS.parse(&v)? as usize;
        }
        if let Some(v) = lookup("BRAID_SPIN_US") {
            c.spin_us = Some(SPIN_US.parse(&v)?);
        }
        if let Some(v) = lookup("BRAID_ALGO") {
            // Checked by the communicator, which knows the algorithms.
            c.algo = Some(v.trim().to_string()).filter(|v| !v.is_empty());
        }
        if let Some(v) = lookup("BRAID_TIMELINE") {
            c.timeline = Some(std::path::PathBuf::from(v)).filter(|p| !p.as_os_str().is_empty());
        }
        if let Some(v) = lookup("BRAID_TUNE_FILE") {
            c.tune_file = Some(std::path::PathBuf::from(v)).filter(|p| !p.as_os_str().is_empty());
        }
        if let Some(v) = lookup("BRAID_DIRECT_MAX_BYTES") {
            c.direct_max_bytes = DIRECT_MAX_BYTES.parse(&v)? as usize;
        }
        if let Some(v) = lookup("BRAID_BUCKET_BYTES") {
            c.bucket_bytes = BUCKET_BYTES.parse(&v)? as usize;
        }
        if let Some(v) = lookup("BRAID_DEBUG_CHECKS") {
            c.debug_checks = parse_bool("BRAID_DEBUG_CHECKS", &v)?;
        }
        if let Some(v) = lookup("BRAID_DUMP_ON_TIMEOUT") {
            c.dump_on_timeout = parse_bool("BRAID_DUMP_ON_TIMEOUT", &v)?;
        }
        if let Some(v) = lookup("BRAID_TRANSPORT") {
            let t = v.trim().to_ascii_lowercase();
            c.transport = if t.is_empty() { "auto".into() } else { t };
        }
        if let Some(v) = lookup("BRAID_SOCKETS_PER_PEER") {
            c.sockets_per_peer = SOCKETS_PER_PEER.parse(&v)? as usize;
        }
        if let Some(v) = lookup("BRAID_SOCKET_IFNAME") {
            c.socket_ifname = Some(v.trim().to_string()).filter(|v| !v.is_empty());
        }
        if let Some(v) = lookup("BRAID_HOST_ID") {
            c.host_id = Some(v.trim().to_string()).filter(|v| !v.is_empty());
        }
        if let Some(v) = lookup("BRAID_TOPO_FILE") {
            c.topo_file = Some(std::path::PathBuf::from(v)).filter(|p| !p.as_os_str().is_empty());
        }
        if let Some(v) = lookup("BRAID_TOPO_PROBE") {
            c.topo_probe = parse_bool("BRAID_TOPO_PROBE", &v)?;
        }
        if let Some(v) = lookup("BRAID_TOPO_DUMP_FILE") {
            c.topo_dump_file =
                Some(std::path::PathBuf::from(v)).filter(|p| !p.as_os_str().is_empty());
        }
        if let Some(v) = lookup("BRAID_DEBUG") {
            c.debug = match v.trim().to_ascii_lowercase().as_str() {
                "" | "error" | "off" | "none" => DebugLevel::Error,
                "warn" => DebugLevel::Warn,
                "info" => DebugLevel::Info,
                "debug" => DebugLevel::Debug,
                "trace" => DebugLevel::Trace,
                _ => {
                    return Err(Error::invalid(format!(
                        "BRAID_DEBUG={v:?} is not a level (warn, info, debug, trace)"
                    )))
                }
            };
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn defaults_without_variables() {
        assert_eq!(Config::from_lookup(|_| None).unwrap(), Config::default());
    }

    #[test]
    fn the_variables_read_are_exactly_the_listed_ones() {
        let asked = std::cell::RefCell::new(Vec::new());
        Config::from_lookup(|k| {
            asked.borrow_mut().push(k.to_string());
            None
        })
        .unwrap();
        let mut asked = asked.into_inner();
        asked.sort();
        let mut listed: Vec<String> = Config::VARIABLES.iter().map(|v| v.to_string()).collect();
        listed.sort();
        assert_eq!(
            asked, listed,
            "the variables from_lookup reads vs Config::VARIABLES"
        );
    }

    #[test]
    fn variables_override_defaults() {
        let c = Config::from_lookup(env(&[
            ("BRAID_TIMEOUT_MS", "2500"),
            ("BRAID_CHUNK_BYTES", "4096"),
            ("BRAID_SLOTS", "4"),
            ("BRAID_ALGO", "Direct"),
            ("BRAID_DEBUG", "info"),
            ("BRAID_TRANSPORT", "TCP"),
            ("BRAID_SOCKETS_PER_PEER", "4"),
            ("BRAID_SOCKET_IFNAME", "eth,^docker"),
            ("BRAID_HOST_ID", "node-7"),
        ]))
        .unwrap();
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.chunk_bytes, 4096);
        assert_eq!(c.slots, 4);
        assert_eq!(c.algo.as_deref(), Some("Direct"));
        assert_eq!(c.debug, DebugLevel::Info);
        assert_eq!(c.transport, "tcp");
        assert_eq!(c.sockets_per_peer, 4);
        assert_eq!(c.socket_ifname.as_deref(), Some("eth,^docker"));
        assert_eq!(c.host_id.as_deref(), Some("node-7"));
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (k, v) in [
            ("BRAID_TIMEOUT_MS", "soon"),
            ("BRAID_TIMEOUT_MS", "0"),
            ("BRAID_CHUNK_BYTES", "8"),
            ("BRAID_SLOTS", "1"),
            ("BRAID_SLOTS", "3"),
            ("BRAID_SLOTS", "48"),
            ("BRAID_DEBUG", "loud"),
            ("BRAID_SOCKETS_PER_PEER", "0"),
            ("BRAID_SOCKETS_PER_PEER", "99"),
        ] {
            let e = Config::from_lookup(env(&[(k, v)])).unwrap_err();
            assert!(e.is_invalid_argument());
            assert!(e.to_string().contains(k), "{e}");
        }
        assert!(parse_bool("X", "maybe").is_err());
        assert!(parse_bool("X", "1").unwrap());
    }

    #[test]
    fn built_configs_are_checked_with_the_variables_ranges() {
        assert!(Config::default().check().is_ok());
        // Every value the environment accepts at either end of its range passes the check.
        for end in ["min", "max"] {
            let value = |l: &Limit| if end == "min" { l.min } else { l.max };
            let vars: Vec<(&str, String)> = [
                &TIMEOUT_MS,
                &CHUNK_BYTES,
                &SLOTS,
                &STREAMS,
                &CHANNELS,
                &SPIN_US,
                &DIRECT_MAX_BYTES,
                &BUCKET_BYTES,
                &SOCKETS_PER_PEER,
            ]
            .into_iter()
            .map(|l| (l.var, value(l).to_string()))
            .collect();
            let c =
                Config::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()))
                    .unwrap();
            c.check().unwrap();
        }
        // Each field out of its range is refused, naming the field and the variable.
        let d = Config::default;
        for (c, field, var) in [
            (
                Config {
                    timeout: Duration::MAX,
                    ..d()
                },
                "timeout",
                "BRAID_TIMEOUT_MS",
            ),
            (
                Config {
                    timeout: Duration::from_micros(500),
                    ..d()
                },
                "timeout",
                "BRAID_TIMEOUT_MS",
            ),
            (
                Config {
                    chunk_bytes: 0,
                    ..d()
                },
                "chunk_bytes",
                "BRAID_CHUNK_BYTES",
            ),
            (
                Config {
                    chunk_bytes: usize::MAX,
                    ..d()
                },
                "chunk_bytes",
                "BRAID_CHUNK_BYTES",
            ),
            (Config { slots: 1, ..d() }, "slots", "BRAID_SLOTS"),
            (Config { slots: 128, ..d() }, "slots", "BRAID_SLOTS"),
            (Config { streams: 0, ..d() }, "streams", "BRAID_STREAMS"),
            (Config { streams: 9, ..d() }, "streams", "BRAID_STREAMS"),
            (Config { channels: 0, ..d() }, "channels", "BRAID_CHANNELS"),
            (
                Config {
                    spin_us: Some(u64::MAX),
                    ..d()
                },
                "spin_us",
                "BRAID_SPIN_US",
            ),
            (
                Config {
                    direct_max_bytes: usize::MAX,
                    ..d()
                },
                "direct_max_bytes",
                "BRAID_DIRECT_MAX_BYTES",
            ),
            (
                Config {
                    bucket_bytes: 0,
                    ..d()
                },
                "bucket_bytes",
                "BRAID_BUCKET_BYTES",
            ),
            (
                Config {
                    sockets_per_peer: 0,
                    ..d()
                },
                "sockets_per_peer",
                "BRAID_SOCKETS_PER_PEER",
            ),
        ] {
            let e = c.check().unwrap_err();
            assert!(e.is_invalid_argument(), "{e:?}");
            let text = e.to_string();
            assert!(text.contains(field) && text.contains(var), "{text}");
        }
        // Within range but not a power of two.
        let e = Config { slots: 3, ..d() }.check().unwrap_err();
        assert!(e.is_invalid_argument(), "{e:?}");
        let text = e.to_string();
        assert!(text.contains("slots") && text.contains("3 slots"), "{text}");
    }
}
