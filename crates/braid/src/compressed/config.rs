//! The text form of a [`CompressionConfig`]: one grammar for the environment, the C ABI, Python and
//! `braid compress-eval`.

use std::fmt;
use std::str::FromStr;

use braid_compress::{echo_input, DensityWarmup};
use braid_core::Error;

use super::options::{message, AdamSafe, AdamSend, ClipScope, CompressionConfig};

/// The options the grammar accepts, for error messages.
const OPTIONS: &str =
    "ef, noef, decay=X, clip=X, gclip=X, momentum=M, mask, warmup=STEPS[:START], flush=STEPS, \
                       adam=STEPS[:BETA1], adamsend=moment|gradient, switch=X, sparse=allgather|reducescatter|auto, seed=N, adaptive";

/// Density a warm-up starts from when the text gives none (Deep Gradient Compression's 25%).
pub const DEFAULT_WARMUP_START: f32 = 0.25;

/// `CODEC[/OPTION]...`: the codec in [`CodecSpec`](crate::CodecSpec)'s text form, then options separated by `/`, each at
/// most once:
///
/// | option | meaning |
/// |---|---|
/// | `ef`, `noef` | error feedback on (the default) or off |
/// | `decay=X` | weight of the remembered error, in `[0, 1]` |
/// | `clip=X` | clip each rank's gradient to L2 norm `X` before compressing ([`ClipScope::Local`]) |
/// | `gclip=X` | clip to `X` by the all-reduced gradient's norm ([`ClipScope::Global`]) |
/// | `momentum=M` | momentum correction with factor `M` in `[0, 1)`; the optimizer runs plain SGD |
/// | `mask` | momentum correction with DGC's momentum factor masking |
/// | `warmup=STEPS[:START]` | density warm-up from `START` (0.25) over `STEPS` steps |
/// | `flush=STEPS` | every `STEPS`-th step is sent whole (dense), applying the held-back residual |
/// | `adam=STEPS[:BETA1]` | Adam-safe compression after `STEPS` dense steps, β1 0.9 unless given |
/// | `adamsend=moment\|gradient` | what Adam-safe compression compresses ([`AdamSend`]; default by codec) |
/// | `switch=X` | top-k's dense switch, a number ≥ 0 |
/// | `sparse=allgather\|reducescatter\|auto` | top-k's way through the network ([`SparsePath`](crate::SparsePath)) |
/// | `seed=N` | the codecs' seed |
/// | `adaptive` | the optimizer is adaptive: warn below 1% density |
///
/// E.g. `topk:0.01/momentum=0.9/warmup=200`, `int8/adam=100`, `topk:0.1/noef`. Case and spaces are
/// ignored. The result is validated; an error names the bad part.
impl FromStr for CompressionConfig {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self, Error> {
        let mut parts = text.split('/');
        let codec_text = parts.next().unwrap_or_default();
        let mut c = CompressionConfig {
            codec: codec_text.parse()?,
            ..CompressionConfig::default()
        };
        let bad = |why: String| {
            Error::invalid(format!(
                "compression {}: {why}; options: {OPTIONS}",
                echo_input(text)
            ))
        };
        let mut seen: Vec<String> = Vec::new();
        // `adamsend` without `adam=STEPS` is an error once every option is read.
        let mut pending_send = false;
        for part in parts {
            let part = part.trim().to_ascii_lowercase();
            let (key, value) = match part.split_once('=') {
                Some((k, v)) => (k.trim().to_string(), Some(v.trim().to_string())),
                None => (part.clone(), None),
            };
            // `ef` and `noef` are one option.
            let family = if key == "noef" {
                "ef".to_string()
            } else {
                key.clone()
            };
            if seen.contains(&family) {
                return Err(bad(format!("option {} is given twice", echo_input(&key))));
            }
            seen.push(family);
            let num = |what: &str| -> Result<f64, Error> {
                let v = value
                    .as_deref()
                    .ok_or_else(|| bad(format!("{what} needs a value ({what}=...)")))?;
                // Infinity is a number here (a dense switch that never switches); validation refuses it
                // wherever it is not meaningful.
                v.parse::<f64>()
                    .map_err(|_| bad(format!("{what}={} is not a number", echo_input(v))))
            };
            let flag = |on: bool| -> Result<bool, Error> {
                match &value {
                    None => Ok(on),
                    Some(v) => Err(bad(format!("{key} takes no value, got {}", echo_input(v)))),
                }
            };
            // `STEPS[:X]`: a step count and an optional number.
            let steps_and = |what: &str| -> Result<(u64, Option<f64>), Error> {
                let v = value
                    .as_deref()
                    .ok_or_else(|| bad(format!("{what} needs a value ({what}=STEPS)")))?;
                let (s, x) = match v.split_once(':') {
                    Some((s, x)) => (s.trim(), Some(x.trim())),
                    None => (v, None),
                };
                let steps = s.parse::<u64>().map_err(|_| {
                    bad(format!(
                        "{what}: the step count {} is not an integer ≥ 0",
                        echo_input(s)
                    ))
                })?;
                let x = match x {
                    None => None,
                    Some(x) => Some(x.parse::<f64>().ok().filter(|x| x.is_finite()).ok_or_else(
                        || bad(format!("{what}: {} is not a number", echo_input(x))),
                    )?),
                };
                Ok((steps, x))
            };
            match key.as_str() {
                "ef" => c.error_feedback = flag(true)?,
                "noef" => c.error_feedback = flag(false)?,
                "decay" => c.decay = Some(num("decay")? as f32),
                "clip" | "gclip" => {
                    if seen.iter().filter(|k| k.ends_with("clip")).count() > 1 {
                        return Err(bad("clip and gclip exclude each other".into()));
                    }
                    c.clip_norm = Some(num(&key)? as f32);
                    c.clip_scope = if key == "clip" {
                        ClipScope::Local
                    } else {
                        ClipScope::Global
                    };
                }
                "momentum" => c.momentum = Some(num("momentum")? as f32),
                "mask" => c.momentum_masking = flag(true)?,
                "warmup" => {
                    let (steps, start) = steps_and("warmup")?;
                    let start = start.map_or(DEFAULT_WARMUP_START, |x| x as f32);
                    c.warmup =
                        Some(DensityWarmup::new(start, steps).map_err(|e| bad(e.to_string()))?);
                }
                "flush" => {
                    let (steps, extra) = steps_and("flush")?;
                    if extra.is_some() {
                        return Err(bad("flush takes one step count: flush=STEPS".into()));
                    }
                    c.flush = Some(steps);
                }
                "adam" => {
                    let (warmup_steps, beta1) = steps_and("adam")?;
                    let send = c.adam.map_or(AdamSend::Auto, |a| a.send);
                    c.adam = Some(AdamSafe {
                        warmup_steps,
                        beta1: beta1.map_or(AdamSafe::default().beta1, |b| b as f32),
                        send,
                    });
                }
                "adamsend" => {
                    let send = match value.as_deref() {
                        Some("moment") => AdamSend::Moment,
                        Some("gradient") => AdamSend::Gradient,
                        other => {
                            return Err(bad(format!(
                                "adamsend takes moment or gradient, got {}",
                                echo_input(other.unwrap_or(""))
                            )))
                        }
                    };
                    // Order-free: the warm-up may come before or after.
                    c.adam = Some(AdamSafe {
                        send,
                        ..c.adam.unwrap_or_default()
                    });
                    pending_send = true;
                }
                "switch" => c.dense_switch = num("switch")?,
                "sparse" => {
                    let v = value
                        .as_deref()
                        .ok_or_else(|| bad("sparse needs a value (sparse=allgather)".into()))?;
                    c.sparse_path = v
                        .parse()
                        .map_err(|e| bad(format!("sparse={}: {}", echo_input(v), message(e))))?;
                }
                "seed" => {
                    let v = value
                        .as_deref()
                        .ok_or_else(|| bad("seed needs a value (seed=N)".into()))?;
                    c.seed = v.parse().map_err(|_| {
                        bad(format!("seed={} is not an integer ≥ 0", echo_input(v)))
                    })?;
                }
                "adaptive" => c.adaptive_optimizer = flag(true)?,
                "" => {
                    return Err(bad(
                        "an empty option (two slashes, or a trailing one)".into()
                    ))
                }
                other => return Err(bad(format!("unknown option {}", echo_input(other)))),
            }
        }
        if pending_send && !seen.iter().any(|k| k == "adam") {
            return Err(bad("adamsend needs adam=STEPS".into()));
        }
        c.validate().map_err(|e| bad(message(e))).map(|()| c)
    }
}

/// The canonical text form: the codec and every option that differs from the default. It parses back to
/// the same configuration.
impl fmt::Display for CompressionConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = CompressionConfig::default();
        write!(f, "{}", self.codec)?;
        if !self.error_feedback {
            write!(f, "/noef")?;
        }
        if let Some(x) = self.decay {
            write!(f, "/decay={x}")?;
        }
        if let Some(x) = self.clip_norm {
            let key = match self.clip_scope {
                ClipScope::Local => "clip",
                ClipScope::Global => "gclip",
            };
            write!(f, "/{key}={x}")?;
        }
        if let Some(m) = self.momentum {
            write!(f, "/momentum={m}")?;
        }
        if self.momentum_masking {
            write!(f, "/mask")?;
        }
        if let Some(w) = self.warmup {
            write!(f, "/warmup={}:{}", w.steps, w.start)?;
        }
        if let Some(n) = self.flush {
            write!(f, "/flush={n}")?;
        }
        if let Some(a) = self.adam {
            write!(f, "/adam={}:{}", a.warmup_steps, a.beta1)?;
            match a.send {
                AdamSend::Auto => {}
                AdamSend::Moment => write!(f, "/adamsend=moment")?,
                AdamSend::Gradient => write!(f, "/adamsend=gradient")?,
            }
        }
        if self.dense_switch != d.dense_switch {
            write!(f, "/switch={}", self.dense_switch)?;
        }
        if self.sparse_path != d.sparse_path {
            write!(f, "/sparse={}", self.sparse_path)?;
        }
        if self.seed != d.seed {
            write!(f, "/seed={}", self.seed)?;
        }
        if self.adaptive_optimizer {
            write!(f, "/adaptive")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CodecSpec, SparsePath};

    fn parse(t: &str) -> Result<CompressionConfig, Error> {
        t.parse()
    }

    #[test]
    fn options_set_their_fields_and_print_back() {
        let c = parse("TopK:0.01 / momentum=0.9 / mask / warmup=200 / gclip=1.5 / seed=7").unwrap();
        assert_eq!(c.codec, CodecSpec::TopK { density: 0.01 });
        assert_eq!(c.momentum, Some(0.9));
        assert_eq!(
            c.warmup,
            Some(DensityWarmup {
                start: 0.25,
                steps: 200
            })
        );
        assert_eq!((c.clip_norm, c.clip_scope), (Some(1.5), ClipScope::Global));
        assert_eq!(c.seed, 7);
        assert!(c.error_feedback);
        let text = c.to_string();
        assert!(c.momentum_masking);
        assert_eq!(
            text,
            "topk:0.01/gclip=1.5/momentum=0.9/mask/warmup=200:0.25/seed=7"
        );
        let back = parse(&text).unwrap();
        assert_eq!(format!("{back:?}"), format!("{c:?}"));

        let rs = parse("topk:0.01/sparse=reducescatter").unwrap();
        assert_eq!(rs.sparse_path, SparsePath::ReduceScatter);
        assert_eq!(rs.to_string(), "topk:0.01/sparse=reducescatter");
        assert_eq!(parse("topk").unwrap().sparse_path, SparsePath::AllGather);
        let a =
            parse("int8/adamsend=gradient/adam=50:0.8/noef/clip=2/switch=0.3/adaptive/decay=0.5")
                .unwrap();
        assert_eq!(
            a.adam,
            Some(AdamSafe {
                warmup_steps: 50,
                beta1: 0.8,
                send: AdamSend::Gradient,
            })
        );
        assert!(!a.error_feedback && a.adaptive_optimizer);
        assert_eq!((a.clip_norm, a.clip_scope), (Some(2.0), ClipScope::Local));
        assert_eq!((a.dense_switch, a.decay), (0.3, Some(0.5)));
        assert_eq!(
            format!("{:?}", parse(&a.to_string()).unwrap()),
            format!("{a:?}")
        );
        assert_eq!(parse("topk").unwrap().to_string(), "topk:0.1");
    }

    #[test]
    fn bad_options_are_named() {
        for (text, says) in [
            ("topk:0.1/frob", "unknown option \"frob\""),
            ("topk:0.1/noef/ef", "given twice"),
            ("topk:0.1/clip=1/gclip=1", "exclude each other"),
            ("topk:0.1/clip=x", "clip=\"x\" is not a number"),
            ("topk:0.1/clip=-1", "clip norm"),
            ("topk:0.1/momentum=1", "momentum factor"),
            ("dense/momentum=0.9", "needs a codec that compresses"),
            ("powersgd:2/momentum=0.9", "needs a codec that compresses"),
            ("int8/warmup=10", "needs a codec with a density"),
            ("topk/warmup=10:0", "start density"),
            ("topk/warmup=ten", "step count \"ten\""),
            ("topk/adam=10:1.5", "beta1"),
            ("topk/adam=10/momentum=0.9", "choose one"),
            ("topk/adamsend=gradient", "needs adam=STEPS"),
            ("topk/mask", "momentum correction is off"),
            ("topk/sparse=sideways", "not a sparse path"),
            ("topk/adam=5/adamsend=sideways", "moment or gradient"),
            ("topk//noef", "empty option"),
            ("topk/noef=1", "takes no value"),
            ("topk/seed=-1", "seed=\"-1\""),
            ("frob/noef", "unknown codec"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
