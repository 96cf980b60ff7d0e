//! The RDMA transport's settings, the `BRAID_IB_*` variables: parsed and checked here whether or not
//! the transport is built, so that a bad value is an error at communicator creation in every build
//! (the registry reads them first), and their one type is the one the transport uses.

use braid_core::{Error, Limit};

use super::wire::{HcaFilter, MAX_QPS};

const QPS_PER_PEER: Limit = Limit::new("BRAID_IB_QPS_PER_PEER", "qps_per_peer", 1, MAX_QPS as u64);
const GID_INDEX: Limit = Limit::new("BRAID_IB_GID_INDEX", "gid_index", 0, 255);
const TC: Limit = Limit::new("BRAID_IB_TC", "traffic_class", 0, 255);
const TIMEOUT: Limit = Limit::new("BRAID_IB_TIMEOUT", "timeout", 1, 31);
const RETRY_CNT: Limit = Limit::new("BRAID_IB_RETRY_CNT", "retry_cnt", 0, 7);
const MTU: Limit = Limit::new("BRAID_IB_MTU", "mtu", 256, 4096);
const TEST_BAD_RKEY: Limit = Limit::new(
    "BRAID_IB_TEST_BAD_RKEY",
    "bad_rkey_rank",
    0,
    u32::MAX as u64,
);

/// What the `BRAID_IB_*` variables say (or a program sets).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IbOptions {
    /// Devices and ports it may use, in NCCL's syntax: `mlx5_0:1,mlx5_1` (name prefixes, optional
    /// port), `=name` for exact names, a leading `^` to exclude (`BRAID_IB_HCA`; default: all).
    pub hca: HcaFilter,
    /// Queue pairs per peer; messages of more than 64 KiB are striped over them
    /// (`BRAID_IB_QPS_PER_PEER`, default 1, at most 16).
    pub qps_per_peer: usize,
    /// GID index; `None` picks RoCE v2 over IPv4, then RoCE v2, then the first
    /// (`BRAID_IB_GID_INDEX`).
    pub gid_index: Option<u32>,
    /// Traffic class of its packets, for the ECN/PFC classes RoCE fabrics configure (`BRAID_IB_TC`,
    /// default 0).
    pub traffic_class: u8,
    /// ACK timeout exponent: 4.096 µs × 2^n per try (`BRAID_IB_TIMEOUT`, default 14, 1 to 31).
    pub timeout: u8,
    /// Transport retries before a queue pair fails (`BRAID_IB_RETRY_CNT`, default 7, at most 7).
    pub retry_cnt: u8,
    /// Path MTU in bytes, 256 to 4096, at most the ports' (`BRAID_IB_MTU`; default: the ports'
    /// active MTU).
    pub mtu: Option<u32>,
    /// Fault injection for tests: this rank's data writes carry a wrong remote key, so the peer's
    /// device refuses them (`BRAID_IB_TEST_BAD_RKEY=<rank>`).
    pub bad_rkey_rank: Option<usize>,
}

impl Default for IbOptions {
    fn default() -> Self {
        IbOptions {
            hca: HcaFilter::default(),
            qps_per_peer: 1,
            gid_index: None,
            traffic_class: 0,
            timeout: 14,
            retry_cnt: 7,
            mtu: None,
            bad_rkey_rank: None,
        }
    }
}

/// Why `mtu` is not an MTU the verbs API names (`None`: it is one).
fn mtu_refused(mtu: u32) -> Option<String> {
    (!mtu.is_power_of_two()).then(|| format!("{mtu} is not 256, 512, 1024, 2048 or 4096"))
}

impl IbOptions {
    /// Every variable [`IbOptions::from_lookup`] reads (the environment page of the docs must
    /// document each one; a test checks it).
    pub const VARIABLES: &'static [&'static str] = &[
        "BRAID_IB_HCA",
        "BRAID_IB_QPS_PER_PEER",
        "BRAID_IB_GID_INDEX",
        "BRAID_IB_TC",
        "BRAID_IB_TIMEOUT",
        "BRAID_IB_RETRY_CNT",
        "BRAID_IB_MTU",
        "BRAID_IB_TEST_BAD_RKEY",
    ];

    /// The defaults overridden by the process environment.
    pub fn from_env() -> Result<IbOptions, Error> {
        IbOptions::from_lookup(|k| std::env::var(k).ok())
    }

    /// The defaults overridden by what `lookup` says of each variable; a value that does not parse
    /// or is out of range is an error naming the variable.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<IbOptions, Error> {
        let lookup = |name: &str| {
            debug_assert!(
                IbOptions::VARIABLES.contains(&name),
                "{name} is read but missing from IbOptions::VARIABLES"
            );
            lookup(name)
        };
        let mut o = IbOptions::default();
        if let Some(v) = lookup("BRAID_IB_HCA") {
            o.hca = HcaFilter::parse(&v)?;
        }
        if let Some(v) = lookup("BRAID_IB_QPS_PER_PEER") {
            o.qps_per_peer = QPS_PER_PEER.parse(&v)? as usize;
        }
        if let Some(v) = lookup("BRAID_IB_GID_INDEX") {
            o.gid_index = Some(GID_INDEX.parse(&v)? as u32);
        }
        if let Some(v) = lookup("BRAID_IB_TC") {
            o.traffic_class = TC.parse(&v)? as u8;
        }
        if let Some(v) = lookup("BRAID_IB_TIMEOUT") {
            o.timeout = TIMEOUT.parse(&v)? as u8;
        }
        if let Some(v) = lookup("BRAID_IB_RETRY_CNT") {
            o.retry_cnt = RETRY_CNT.parse(&v)? as u8;
        }
        if let Some(v) = lookup("BRAID_IB_MTU") {
            let m = MTU.parse(&v)? as u32;
            if let Some(why) = mtu_refused(m) {
                return Err(Error::invalid(format!("BRAID_IB_MTU={why}")));
            }
            o.mtu = Some(m);
        }
        if let Some(v) = lookup("BRAID_IB_TEST_BAD_RKEY") {
            o.bad_rkey_rank = Some(TEST_BAD_RKEY.parse(&v)? as usize);
        }
        Ok(o)
    }

    /// Whether options set in code are within the variables' ranges (an error names the field and
    /// the variable).
    pub fn check(&self) -> Result<(), Error> {
        QPS_PER_PEER.check(self.qps_per_peer as u64)?;
        if let Some(g) = self.gid_index {
            GID_INDEX.check(u64::from(g))?;
        }
        TC.check(u64::from(self.traffic_class))?;
        TIMEOUT.check(u64::from(self.timeout))?;
        RETRY_CNT.check(u64::from(self.retry_cnt))?;
        if let Some(m) = self.mtu {
            MTU.check(u64::from(m))?;
            if let Some(why) = mtu_refused(m) {
                return Err(Error::invalid(format!("config: mtu = {why}")));
            }
        }
        if let Some(r) = self.bad_rkey_rank {
            TEST_BAD_RKEY.check(r as u64)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup<'a>(vars: &'a [(&'a str, String)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn the_variables_read_are_exactly_the_listed_ones() {
        let asked = std::cell::RefCell::new(Vec::new());
        IbOptions::from_lookup(|k| {
            asked.borrow_mut().push(k.to_string());
            None
        })
        .unwrap();
        assert_eq!(asked.into_inner(), IbOptions::VARIABLES);
    }

    #[test]
    fn values_parse_into_the_options_and_both_ends_of_every_range_pass_the_check() {
        let o = IbOptions::from_lookup(lookup(&[
            ("BRAID_IB_HCA", "=rxe0:1".into()),
            ("BRAID_IB_QPS_PER_PEER", "4".into()),
            ("BRAID_IB_GID_INDEX", "3".into()),
            ("BRAID_IB_TC", "106".into()),
            ("BRAID_IB_TIMEOUT", "18".into()),
            ("BRAID_IB_RETRY_CNT", "3".into()),
            ("BRAID_IB_MTU", "1024".into()),
            ("BRAID_IB_TEST_BAD_RKEY", "1".into()),
        ]))
        .unwrap();
        assert_eq!(
            o,
            IbOptions {
                hca: HcaFilter::parse("=rxe0:1").unwrap(),
                qps_per_peer: 4,
                gid_index: Some(3),
                traffic_class: 106,
                timeout: 18,
                retry_cnt: 3,
                mtu: Some(1024),
                bad_rkey_rank: Some(1),
            }
        );
        assert!(o.hca.allows("rxe0", 1) && !o.hca.allows("rxe0", 2));
        assert_eq!(IbOptions::default().check(), Ok(()));
        let limits = [
            QPS_PER_PEER,
            GID_INDEX,
            TC,
            TIMEOUT,
            RETRY_CNT,
            MTU,
            TEST_BAD_RKEY,
        ];
        for end in [Limit::min, Limit::max] {
            let vars: Vec<(&str, String)> = limits
                .iter()
                .map(|l| (l.var(), end(l).to_string()))
                .collect();
            IbOptions::from_lookup(lookup(&vars))
                .unwrap()
                .check()
                .unwrap();
        }
    }

    #[test]
    fn bad_values_are_errors_naming_the_variable() {
        for (var, value, says) in [
            ("BRAID_IB_QPS_PER_PEER", "0", "out of range"),
            ("BRAID_IB_QPS_PER_PEER", "17", "out of range"),
            ("BRAID_IB_GID_INDEX", "-1", "not a non-negative integer"),
            ("BRAID_IB_TIMEOUT", "32", "out of range"),
            ("BRAID_IB_RETRY_CNT", "8", "out of range"),
            ("BRAID_IB_MTU", "1000", "is not 256"),
            ("BRAID_IB_MTU", "8192", "out of range"),
            ("BRAID_IB_HCA", "^", "names no device"),
            ("BRAID_IB_TC", "x", "not a non-negative integer"),
        ] {
            let e = IbOptions::from_lookup(lookup(&[(var, value.into())])).unwrap_err();
            assert!(e.is_invalid_argument(), "{e:?}");
            let text = e.to_string();
            assert!(
                text.contains(var) && text.contains(says),
                "{var}={value}: {text}"
            );
        }
    }

    #[test]
    fn options_set_in_code_out_of_range_are_refused_naming_field_and_variable() {
        let d = IbOptions::default;
        for (o, field, says) in [
            (
                IbOptions {
                    qps_per_peer: 17,
                    ..d()
                },
                "qps_per_peer",
                "BRAID_IB_QPS_PER_PEER",
            ),
            (
                IbOptions {
                    gid_index: Some(256),
                    ..d()
                },
                "gid_index",
                "BRAID_IB_GID_INDEX",
            ),
            (
                IbOptions { timeout: 0, ..d() },
                "timeout",
                "BRAID_IB_TIMEOUT",
            ),
            (
                IbOptions {
                    retry_cnt: 8,
                    ..d()
                },
                "retry_cnt",
                "BRAID_IB_RETRY_CNT",
            ),
            (
                IbOptions {
                    mtu: Some(8192),
                    ..d()
                },
                "mtu",
                "BRAID_IB_MTU",
            ),
            (
                IbOptions {
                    mtu: Some(1000),
                    ..d()
                },
                "mtu",
                "1000 is not",
            ),
            (
                IbOptions {
                    bad_rkey_rank: Some(usize::MAX),
                    ..d()
                },
                "bad_rkey_rank",
                "BRAID_IB_TEST_BAD_RKEY",
            ),
        ] {
            let e = o.check().unwrap_err();
            assert!(e.is_invalid_argument(), "{e:?}");
            let text = e.to_string();
            assert!(text.contains(field) && text.contains(says), "{text}");
        }
    }

    #[test]
    fn the_docs_document_every_variable() {
        let page =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/src/environment.md");
        let text =
            std::fs::read_to_string(&page).unwrap_or_else(|e| panic!("{}: {e}", page.display()));
        for var in IbOptions::VARIABLES {
            let row = format!("| `{var}` |");
            assert!(
                text.lines().any(|l| l.trim_start().starts_with(&row)),
                "{} has no table row for {var}",
                page.display()
            );
        }
    }
}
