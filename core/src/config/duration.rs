//! Go's `time.Duration` as kube-proxy's configuration writes and reads it (`metav1.Duration`):
//! signed, parsed as `time.ParseDuration` parses (`1m0s`, `1.5h`, `-5s`, `300ms`, `0`) and
//! printed as Go prints it (`1m0s`, `500ms`, `0s`), so `/configz` and error messages show the
//! values upstream would.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A signed duration in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct GoDuration(pub i64);

const NS: i64 = 1;
const US: i64 = 1_000;
const MS: i64 = 1_000_000;
const S: i64 = 1_000_000_000;
const M: i64 = 60 * S;
const H: i64 = 60 * M;

impl GoDuration {
    /// Zero, the value of an absent or `0s` field.
    pub const ZERO: GoDuration = GoDuration(0);

    /// From a standard duration (saturating at Go's maximum, about 292 years).
    pub fn from_std(d: Duration) -> GoDuration {
        GoDuration(i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
    }

    /// Whole seconds.
    pub const fn from_secs(s: i64) -> GoDuration {
        GoDuration(s * S)
    }

    /// The duration, when it is not negative.
    pub fn to_std(self) -> Option<Duration> {
        u64::try_from(self.0).ok().map(Duration::from_nanos)
    }

    /// Parses as Go's `time.ParseDuration`: an optional sign, then one or more decimal numbers
    /// each with a unit (`ns`, `us`, `µs`, `ms`, `s`, `m`, `h`); `0` alone is allowed.
    pub fn parse(text: &str) -> Option<GoDuration> {
        let mut s = text;
        let negative = s.starts_with('-');
        if negative || s.starts_with('+') {
            s = &s[1..];
        }
        if s == "0" {
            return Some(GoDuration::ZERO);
        }
        if s.is_empty() {
            return None;
        }
        let mut total: i128 = 0;
        while !s.is_empty() {
            let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
            let (whole, rest) = s.split_at(digits);
            let (fraction, rest) = match rest.strip_prefix('.') {
                Some(r) => {
                    let n = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
                    r.split_at(n)
                }
                None => ("", rest),
            };
            if whole.is_empty() && fraction.is_empty() {
                return None;
            }
            let unit_len = rest.find(|c: char| c == '.' || c.is_ascii_digit()).unwrap_or(rest.len());
            let (unit, rest) = rest.split_at(unit_len);
            let scale: i64 = match unit {
                "ns" => NS,
                "us" | "µs" | "μs" => US,
                "ms" => MS,
                "s" => S,
                "m" => M,
                "h" => H,
                _ => return None,
            };
            // Go refuses what overflows 64 bits; checked arithmetic never wraps here either.
            let whole: i128 = if whole.is_empty() { 0 } else { whole.parse().ok()? };
            total = total.checked_add(whole.checked_mul(i128::from(scale))?)?;
            if !fraction.is_empty() {
                // Digits beyond nanoseconds do not change the result; keep 18 at most.
                let fraction = &fraction[..fraction.len().min(18)];
                let f: i128 = fraction.parse().ok()?;
                total = total.checked_add(f.checked_mul(i128::from(scale))? / 10i128.pow(fraction.len() as u32))?;
            }
            if total > i128::from(i64::MAX) {
                return None;
            }
            s = rest;
        }
        let total = i64::try_from(total).ok()?;
        Some(GoDuration(if negative { -total } else { total }))
    }
}

/// `v` with `digits` decimal places, trailing zeros (and a bare point) removed.
fn decimal(v: u128, digits: u32) -> String {
    let scale = 10u128.pow(digits);
    let (whole, frac) = (v / scale, v % scale);
    if frac == 0 {
        return whole.to_string();
    }
    let frac = format!("{frac:0width$}", width = digits as usize);
    format!("{whole}.{}", frac.trim_end_matches('0'))
}

impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let u = self.0.unsigned_abs() as u128;
        let body = if u == 0 {
            "0s".to_string()
        } else if u < US as u128 {
            format!("{u}ns")
        } else if u < MS as u128 {
            format!("{}µs", decimal(u, 3))
        } else if u < S as u128 {
            format!("{}ms", decimal(u, 6))
        } else {
            let seconds = decimal(u % M as u128, 9);
            let minutes = u / M as u128;
            match (minutes / 60, minutes % 60) {
                (0, 0) => format!("{seconds}s"),
                (0, m) => format!("{m}m{seconds}s"),
                (h, m) => format!("{h}h{m}m{seconds}s"),
            }
        };
        write!(f, "{sign}{body}")
    }
}

impl Serialize for GoDuration {
    fn serialize<Z: Serializer>(&self, s: Z) -> Result<Z::Ok, Z::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    /// A string Go can parse, or null (zero), as `metav1.Duration` reads it.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(GoDuration::ZERO),
            Some(s) => {
                GoDuration::parse(&s).ok_or_else(|| serde::de::Error::custom(format!("time: invalid duration {s:?}")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_as_go_does() {
        let cases = [
            ("0", 0),
            ("0s", 0),
            ("30s", 30 * S),
            ("1m0s", M),
            ("1h0m0s", H),
            ("24h0m0s", 24 * H),
            ("1.5h", H + 30 * M),
            ("300ms", 300 * MS),
            ("-5s", -5 * S),
            ("+2m", 2 * M),
            ("1h2m3.5s", H + 2 * M + 3 * S + S / 2),
            ("250us", 250 * US),
            ("250µs", 250 * US),
            ("7ns", 7),
            (".5s", S / 2),
        ];
        for (text, ns) in cases {
            assert_eq!(GoDuration::parse(text), Some(GoDuration(ns)), "{text}");
        }
        for bad in [
            "",
            "5",
            "s",
            "1x",
            "soon",
            "-",
            "1.s.",
            "--1s",
            "9999999999999999999999999999999999999h",
            "9223372036854775808ns",
        ] {
            assert_eq!(GoDuration::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn prints_as_go_does() {
        let cases = [
            (0, "0s"),
            (30 * S, "30s"),
            (M, "1m0s"),
            (90 * S, "1m30s"),
            (H, "1h0m0s"),
            (24 * H, "24h0m0s"),
            (H + M + S, "1h1m1s"),
            (S + S / 2, "1.5s"),
            (500 * MS, "500ms"),
            (250 * MS, "250ms"),
            (1_500, "1.5µs"),
            (100, "100ns"),
            (-5 * S, "-5s"),
        ];
        for (ns, text) in cases {
            assert_eq!(GoDuration(ns).to_string(), text);
            assert_eq!(GoDuration::parse(text), Some(GoDuration(ns)), "round trip {text}");
        }
    }
}
