//! The topology file: JSON, versioned, strict about unknown fields, and checked as a whole after parsing
//! so that errors name the rank or field at fault rather than a byte offset.

use std::path::Path;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::model::{Host, Link, RankPlace, Source, Topology};

/// The environment variable naming a topology file for the runtime to use.
pub const TOPO_FILE_ENV: &str = "BRAID_TOPO_FILE";

/// The file format version this build reads and writes.
pub const FORMAT_VERSION: u64 = 1;

#[derive(Serialize, Deserialize)]
#[serde(rename = "Topology", deny_unknown_fields)]
struct FileTopology {
    version: u64,
    #[serde(default = "file_source")]
    source: Source,
    hosts: Vec<Host>,
    ranks: Vec<FileRank>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    links: Vec<Link>,
}

fn file_source() -> Source {
    Source::File
}

#[derive(Serialize, Deserialize)]
#[serde(rename = "Rank", deny_unknown_fields)]
struct FileRank {
    rank: usize,
    host: HostRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    numa: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gpu: Option<usize>,
}

/// A host named in a rank entry: by name (what the writer emits) or by index into `hosts`.
enum HostRef {
    Index(u64),
    Name(String),
}

impl Serialize for HostRef {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            HostRef::Index(i) => s.serialize_u64(*i),
            HostRef::Name(n) => s.serialize_str(n),
        }
    }
}

impl<'de> Deserialize<'de> for HostRef {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = HostRef;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a host name or an index into hosts")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<HostRef, E> {
                Ok(HostRef::Index(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<HostRef, E> {
                Ok(HostRef::Name(v.to_owned()))
            }
        }
        d.deserialize_any(V)
    }
}

impl Topology {
    /// Parses and checks a topology in the file format (see the crate documentation).
    pub fn from_json(text: &str) -> Result<Self> {
        // Read the version first so that a newer file fails on its version, not on a field it added.
        let value: serde_json::Value = serde_json::from_str(text).map_err(parse_error)?;
        if !value.is_object() {
            return Err(Error::Parse {
                line: 1,
                column: 1,
                message: format!(
                    "expected a JSON object holding a topology, found {}",
                    json_kind(&value)
                ),
            });
        }
        match value.get("version") {
            Some(v) => match v.as_u64() {
                Some(FORMAT_VERSION) => {}
                Some(found) => {
                    return Err(Error::UnsupportedVersion {
                        found,
                        supported: FORMAT_VERSION,
                    })
                }
                None => {
                    return Err(Error::invalid(
                        "version",
                        format!("{v} is not a version number"),
                    ))
                }
            },
            None => {
                return Err(Error::invalid(
                    "version",
                    format!("missing; this build reads version {FORMAT_VERSION}"),
                ))
            }
        }
        let file: FileTopology = serde_json::from_str(text).map_err(parse_error)?;
        // Names must be unique before ranks can be resolved by name.
        for (second, host) in file.hosts.iter().enumerate() {
            if let Some(first) = file.hosts[..second]
                .iter()
                .position(|h| h.name == host.name)
            {
                return Err(Error::DuplicateHost {
                    name: host.name.clone(),
                    first,
                    second,
                });
            }
        }
        let mut placed: Vec<(usize, RankPlace)> = Vec::with_capacity(file.ranks.len());
        for (i, entry) in file.ranks.into_iter().enumerate() {
            let host = match entry.host {
                HostRef::Index(h) => usize::try_from(h)
                    .ok()
                    .filter(|&h| h < file.hosts.len())
                    .ok_or_else(|| Error::UnknownHost {
                        rank: entry.rank,
                        host: h.to_string(),
                        hosts: file.hosts.len(),
                    })?,
                HostRef::Name(name) => {
                    file.hosts
                        .iter()
                        .position(|h| h.name == name)
                        .ok_or_else(|| Error::UnknownHost {
                            rank: entry.rank,
                            host: format!("{name:?}"),
                            hosts: file.hosts.len(),
                        })?
                }
            };
            placed.push((
                i,
                RankPlace {
                    rank: entry.rank,
                    host,
                    numa: entry.numa,
                    gpu: entry.gpu,
                },
            ));
        }
        placed.sort_by_key(|(i, p)| (p.rank, *i));
        if let Some(w) = placed.windows(2).find(|w| w[0].1.rank == w[1].1.rank) {
            return Err(Error::DuplicateRank {
                rank: w[0].1.rank,
                first: w[0].0,
                second: w[1].0,
            });
        }
        let world_size = placed.last().map_or(0, |(_, p)| p.rank + 1);
        if placed.len() < world_size {
            let present: std::collections::BTreeSet<usize> =
                placed.iter().map(|(_, p)| p.rank).collect();
            let missing = (0..world_size).filter(|r| !present.contains(r)).collect();
            return Err(Error::MissingRanks {
                world_size,
                missing,
            });
        }
        let topology = Topology {
            hosts: file.hosts,
            ranks: placed.into_iter().map(|(_, p)| p).collect(),
            links: file.links,
            source: file.source,
        };
        topology.validate()?;
        Ok(topology)
    }

    /// The topology in the file format, pretty-printed. Checks it first: an invalid topology is not written.
    pub fn to_json(&self) -> Result<String> {
        self.validate()?;
        let file = FileTopology {
            version: FORMAT_VERSION,
            source: self.source,
            hosts: self.hosts.clone(),
            ranks: self
                .ranks
                .iter()
                .map(|p| FileRank {
                    rank: p.rank,
                    host: HostRef::Name(self.hosts[p.host].name.clone()),
                    numa: p.numa,
                    gpu: p.gpu,
                })
                .collect(),
            links: self.links.clone(),
        };
        let mut text = serde_json::to_string_pretty(&file).map_err(parse_error)?;
        text.push('\n');
        Ok(text)
    }

    /// Reads and checks a topology file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = read_config_file(path).map_err(|source| Error::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_json(&text)
    }

    /// Writes the topology to a file (checking it first).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let text = self.to_json()?;
        std::fs::write(path, text).map_err(|source| Error::Write {
            path: path.to_owned(),
            source,
        })
    }

    /// The topology named by `BRAID_TOPO_FILE`, if the variable is set and not empty, checked against
    /// `world_size` when one is given. Errors name the variable and the file.
    pub fn from_env(world_size: Option<usize>) -> Result<Option<Self>> {
        let path = match std::env::var_os(TOPO_FILE_ENV) {
            None => return Ok(None),
            Some(p) if p.is_empty() => return Ok(None),
            Some(p) => std::path::PathBuf::from(p),
        };
        let wrap = |e: Error| Error::Env {
            var: TOPO_FILE_ENV,
            reason: e.to_string(),
        };
        let topology = Self::load(&path).map_err(wrap)?;
        if let Some(n) = world_size {
            topology.check_world_size(n).map_err(|e| Error::Env {
                var: TOPO_FILE_ENV,
                reason: format!("{}: {e}", path.display()),
            })?;
        }
        Ok(Some(topology))
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn parse_error(e: serde_json::Error) -> Error {
    let mut message = e.to_string();
    // serde_json appends the position, which the error carries in its own fields.
    if let Some(at) = message.rfind(" at line ") {
        message.truncate(at);
    }
    Error::Parse {
        line: e.line(),
        column: e.column(),
        message,
    }
}

/// The largest configuration file (topology, tuning table) braid reads.
pub const MAX_CONFIG_FILE: u64 = 16 << 20;

/// Reads a configuration file named by the user: only a regular file (a device such as `/dev/zero` or
/// a FIFO that nobody writes is refused before it is opened, so reading can neither grow without end nor
/// block), of at most [`MAX_CONFIG_FILE`] bytes.
pub fn read_config_file(path: &Path) -> std::io::Result<String> {
    use std::io::{Error as IoError, ErrorKind, Read};
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(IoError::new(
            ErrorKind::InvalidInput,
            "not a regular file (a device, FIFO or directory is refused)",
        ));
    }
    let too_big = || {
        IoError::new(
            ErrorKind::InvalidData,
            format!("larger than the {MAX_CONFIG_FILE} bytes a configuration file may have"),
        )
    };
    if meta.len() > MAX_CONFIG_FILE {
        return Err(too_big());
    }
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_CONFIG_FILE + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > MAX_CONFIG_FILE {
        return Err(too_big());
    }
    Ok(text)
}
