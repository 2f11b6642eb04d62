//! kube-proxy's own command line, so the image can be swapped under an installer's DaemonSet.
//!
//! Started as `kube-proxy` (the image links `/usr/local/bin/kube-proxy` to nftproxy), or with no
//! subcommand and flags, nftproxy reads its arguments as kube-proxy v1.37 does (pflag syntax:
//! `--flag=value`, `--flag value`, `--bool-flag`, `--bool-flag=false`, `-v=2`, `-v 2`, `-v2`)
//! and runs `nftproxy run` with them. Every flag kube-proxy accepts is accepted: those nftproxy
//! applies are passed on, kube-proxy's own (the mode, the deprecated ports, the per-mode periods,
//! `--master`, `--cleanup`, `--init-only`, `--write-config-to`, `--v`) are carried in
//! [`KubeProxyExtras`], and the rest are named in one warning line each.

use std::collections::BTreeMap;
use std::ffi::OsString;

use thiserror::Error;

use crate::config::duration::GoDuration;

/// The kube-proxy release whose command line and semantics nftproxy follows.
pub const KUBE_PROXY_VERSION: &str = "v1.37.2";

/// What a kube-proxy command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Run the proxy.
    Run,
    /// `--version`: print the version lines and exit.
    Version,
    /// `-h`/`--help`.
    Help,
    /// `--write-config-to`: write the configuration the flags give, then exit.
    WriteConfigTo(String),
    /// `--cleanup`: remove the proxy's rules and kube-proxy's, then exit.
    Cleanup,
    /// `--init-only`: the privileged start-up steps (conntrack sysctls), then exit.
    InitOnly,
}

/// kube-proxy flags that `nftproxy run` has no flag of its own for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubeProxyExtras {
    /// `--proxy-mode`.
    pub mode: Option<String>,
    /// `--oom-score-adj`.
    pub oom_score_adj: Option<i32>,
    /// `--healthz-port` (deprecated; 0 disables the server).
    pub healthz_port: Option<i32>,
    /// `--metrics-port` (deprecated; 0 disables the server).
    pub metrics_port: Option<i32>,
    /// `--iptables-sync-period` / `--iptables-min-sync-period` (the periods of every mode but
    /// ipvs when no config file is given).
    pub iptables_periods: (Option<GoDuration>, Option<GoDuration>),
    /// `--ipvs-sync-period` / `--ipvs-min-sync-period` (mode ipvs).
    pub ipvs_periods: (Option<GoDuration>, Option<GoDuration>),
    /// `--iptables-masquerade-bit`.
    pub iptables_masquerade_bit: Option<i32>,
    /// `--master`: the API server's address, over the kubeconfig's.
    pub master: Option<String>,
    /// `--feature-gates`.
    pub feature_gates: BTreeMap<String, bool>,
    /// `--v`: klog's verbosity.
    pub verbosity: Option<u32>,
    /// component-base's alpha logging options (`--log-json-info-buffer-size`,
    /// `--log-text-split-stream`, …) as `logging.options` fields: (`json.infoBufferSize`, value).
    pub logging_options: Vec<(String, String)>,
    /// Flags given that nftproxy accepts but does not use (names without dashes).
    pub unused: Vec<String>,
    /// Flags given that upstream ignores when `--config` is given (names without dashes).
    pub given: Vec<String>,
}

/// A kube-proxy command line read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Translated {
    /// The same request as an `nftproxy run` command line.
    pub argv: Vec<OsString>,
    pub extras: KubeProxyExtras,
    pub action: Action,
}

/// A command line kube-proxy would refuse, in pflag's and cobra's words.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FlagError {
    #[error("unknown flag: --{0}")]
    Unknown(String),
    #[error("unknown shorthand flag: '{0}' in -{0}")]
    UnknownShorthand(char),
    #[error("flag needs an argument: --{0}")]
    NeedsArgument(String),
    #[error("invalid argument {value:?} for \"--{flag}\" flag: {why}")]
    InvalidArgument { flag: String, value: String, why: String },
    #[error("\"kube-proxy\" does not take any arguments, got {0:?}")]
    Positional(Vec<String>),
    #[error("invalid argument {0:?}: not valid UTF-8")]
    NotUtf8(OsString),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bool,
    Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// `nftproxy run` has the same flag.
    Run,
    /// A comma-separated list that may be repeated (pflag's StringSlice): passed on each time.
    RunList,
    /// Kept in [`KubeProxyExtras`].
    Extra,
    /// Accepted; not used by nftproxy.
    Unused,
}

use Kind::{Bool, Value};
use Target::{Extra, Run, RunList, Unused};

/// Every flag of kube-proxy v1.37 (`cmd/kube-proxy/app/options.go`, component-base's logging
/// flags, verflag's `--version`, cobra's `--help`).
const FLAGS: &[(&str, Kind, Target)] = &[
    ("config", Value, Run),
    ("write-config-to", Value, Extra),
    ("cleanup", Bool, Extra),
    ("feature-gates", Value, Extra),
    ("kubeconfig", Value, Run),
    ("master", Value, Extra),
    ("kube-api-content-type", Value, Unused),
    ("kube-api-burst", Value, Unused),
    ("kube-api-qps", Value, Unused),
    ("hostname-override", Value, Run),
    ("bind-address", Value, Run),
    ("healthz-bind-address", Value, Run),
    ("metrics-bind-address", Value, Run),
    ("bind-address-hard-fail", Bool, Run),
    ("profiling", Bool, Unused),
    ("show-hidden-metrics-for-version", Value, Unused),
    ("init-only", Bool, Extra),
    ("proxy-mode", Value, Extra),
    ("iptables-masquerade-bit", Value, Extra),
    ("masquerade-all", Bool, Run),
    ("iptables-localhost-nodeports", Bool, Unused),
    ("iptables-sync-period", Value, Extra),
    ("iptables-min-sync-period", Value, Extra),
    ("ipvs-sync-period", Value, Extra),
    ("ipvs-min-sync-period", Value, Extra),
    ("ipvs-scheduler", Value, Unused),
    ("ipvs-exclude-cidrs", Value, Unused),
    ("ipvs-strict-arp", Bool, Unused),
    ("ipvs-tcp-timeout", Value, Unused),
    ("ipvs-tcpfin-timeout", Value, Unused),
    ("ipvs-udp-timeout", Value, Unused),
    ("detect-local-mode", Value, Run),
    ("pod-bridge-interface", Value, Run),
    ("pod-interface-name-prefix", Value, Run),
    ("cluster-cidr", Value, Run),
    ("nodeport-addresses", Value, RunList),
    ("oom-score-adj", Value, Extra),
    ("conntrack-max-per-core", Value, Run),
    ("conntrack-min", Value, Run),
    ("conntrack-tcp-timeout-established", Value, Run),
    ("conntrack-tcp-timeout-close-wait", Value, Run),
    ("conntrack-tcp-be-liberal", Bool, Run),
    ("conntrack-udp-timeout", Value, Run),
    ("conntrack-udp-timeout-stream", Value, Run),
    ("config-sync-period", Value, Unused),
    ("healthz-port", Value, Extra),
    ("metrics-port", Value, Extra),
    ("logging-format", Value, Run),
    ("log-flush-frequency", Value, Unused),
    ("v", Value, Extra),
    ("vmodule", Value, Unused),
    ("log-text-split-stream", Bool, Extra),
    ("log-text-info-buffer-size", Value, Extra),
    ("log-json-split-stream", Bool, Extra),
    ("log-json-info-buffer-size", Value, Extra),
    ("version", Bool, Extra),
    ("help", Bool, Extra),
];

/// Flags whose value upstream takes from the file when `--config` is given (all but the
/// hostname, the logging flags, `--master` and the one-shot actions).
const FILE_WINS: &[&str] = &[
    "feature-gates",
    "kubeconfig",
    "kube-api-content-type",
    "kube-api-burst",
    "kube-api-qps",
    "bind-address",
    "healthz-bind-address",
    "metrics-bind-address",
    "bind-address-hard-fail",
    "profiling",
    "show-hidden-metrics-for-version",
    "proxy-mode",
    "iptables-masquerade-bit",
    "masquerade-all",
    "iptables-localhost-nodeports",
    "iptables-sync-period",
    "iptables-min-sync-period",
    "ipvs-sync-period",
    "ipvs-min-sync-period",
    "ipvs-scheduler",
    "ipvs-exclude-cidrs",
    "ipvs-strict-arp",
    "ipvs-tcp-timeout",
    "ipvs-tcpfin-timeout",
    "ipvs-udp-timeout",
    "detect-local-mode",
    "pod-bridge-interface",
    "pod-interface-name-prefix",
    "cluster-cidr",
    "nodeport-addresses",
    "oom-score-adj",
    "conntrack-max-per-core",
    "conntrack-min",
    "conntrack-tcp-timeout-established",
    "conntrack-tcp-timeout-close-wait",
    "conntrack-tcp-be-liberal",
    "conntrack-udp-timeout",
    "conntrack-udp-timeout-stream",
    "config-sync-period",
    "healthz-port",
    "metrics-port",
];

/// nftproxy's subcommands: a command line naming one is nftproxy's own.
const SUBCOMMANDS: &[&str] = &[
    "render",
    "sync",
    "cleanup",
    "check",
    "run",
    "conntrack-sysctls",
    "trace",
    "explain",
    "status",
    "demo",
    "bench",
    "help",
];

/// Whether `argv` is a kube-proxy command line: the program is called `kube-proxy`, or no
/// subcommand is named and the first argument is a flag other than nftproxy's own top-level
/// ones.
pub fn is_kube_proxy(argv: &[OsString]) -> bool {
    let program = argv.first().map(std::path::Path::new).and_then(|p| p.file_name()).and_then(|n| n.to_str());
    if program == Some("kube-proxy") {
        return true;
    }
    let args: Vec<&str> = argv.iter().skip(1).filter_map(|a| a.to_str()).collect();
    let Some(first) = args.first() else { return false };
    let nftproxy_own = ["-h", "--help", "-V", "--version", "-v", "-vv", "-vvv", "--verbose"];
    first.starts_with('-')
        && !nftproxy_own.contains(first)
        && !first.starts_with("--logging-format")
        && !args.iter().any(|a| SUBCOMMANDS.contains(a))
}

/// pflag's `strconv.ParseBool`.
fn parse_bool(flag: &str, value: &str) -> Result<bool, FlagError> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(FlagError::InvalidArgument {
            flag: flag.to_string(),
            value: value.to_string(),
            why: format!("strconv.ParseBool: parsing {value:?}: invalid syntax"),
        }),
    }
}

fn parse_int(flag: &str, value: &str) -> Result<i32, FlagError> {
    value.parse().map_err(|_| FlagError::InvalidArgument {
        flag: flag.to_string(),
        value: value.to_string(),
        why: format!("strconv.ParseInt: parsing {value:?}: invalid syntax"),
    })
}

fn parse_duration(flag: &str, value: &str) -> Result<GoDuration, FlagError> {
    GoDuration::parse(value).ok_or_else(|| FlagError::InvalidArgument {
        flag: flag.to_string(),
        value: value.to_string(),
        why: format!("time: invalid duration {value:?}"),
    })
}

/// `--feature-gates=A=true,B=false`.
fn parse_gates(value: &str, into: &mut BTreeMap<String, bool>) -> Result<(), FlagError> {
    for pair in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').ok_or_else(|| FlagError::InvalidArgument {
            flag: "feature-gates".into(),
            value: value.into(),
            why: format!("malformed pair, expect string=bool: {pair:?}"),
        })?;
        into.insert(k.trim().to_string(), parse_bool("feature-gates", v.trim())?);
    }
    Ok(())
}

/// Reads a kube-proxy command line (`argv[0]` is the program).
pub fn translate(argv: &[OsString]) -> Result<Translated, FlagError> {
    let args: Vec<String> = argv
        .iter()
        .skip(1)
        .map(|a| a.to_str().map(str::to_string).ok_or_else(|| FlagError::NotUtf8(a.clone())))
        .collect::<Result<_, _>>()?;
    let mut pairs: Vec<(&'static str, Kind, Target, String)> = Vec::new();
    let mut positional = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        if arg == "--" {
            positional.extend(args[i..].iter().cloned());
            break;
        }
        let (name, inline) = if let Some(long) = arg.strip_prefix("--") {
            match long.split_once('=') {
                Some((n, v)) => (n.to_string(), Some(v.to_string())),
                None => (long.to_string(), None),
            }
        } else if let Some(short) = arg.strip_prefix('-').filter(|s| !s.is_empty()) {
            let mut chars = short.chars();
            let c = chars.next().unwrap_or('-');
            let rest: String = chars.collect();
            let name = match c {
                'v' => "v",
                'h' => "help",
                _ => return Err(FlagError::UnknownShorthand(c)),
            };
            let inline = match rest.strip_prefix('=') {
                Some(v) => Some(v.to_string()),
                None if !rest.is_empty() => Some(rest),
                None => None,
            };
            (name.to_string(), inline)
        } else {
            positional.push(arg.clone());
            continue;
        };
        // pflag with kube-proxy's WordSepNormalizeFunc: `_` reads as `-`.
        let name = name.replace('_', "-");
        let Some(&(flag, kind, target)) = FLAGS.iter().find(|(n, _, _)| *n == name) else {
            return Err(FlagError::Unknown(name));
        };
        let value = match (kind, inline) {
            (_, Some(v)) => v,
            (Bool, None) => "true".to_string(),
            (Value, None) => {
                let v = args.get(i).cloned().ok_or_else(|| FlagError::NeedsArgument(name.clone()))?;
                i += 1;
                v
            }
        };
        // verflag's --version is a bool that also takes `raw`.
        if kind == Bool && !(flag == "version" && value == "raw") {
            parse_bool(flag, &value)?;
        }
        pairs.push((flag, kind, target, value));
    }
    if !positional.is_empty() {
        return Err(FlagError::Positional(positional));
    }

    let mut extras = KubeProxyExtras::default();
    let mut action = Action::Run;
    let mut run: Vec<(String, String)> = Vec::new();
    for (flag, kind, target, value) in pairs {
        if FILE_WINS.contains(&flag) && !extras.given.iter().any(|g| g == flag) {
            extras.given.push(flag.to_string());
        }
        match target {
            Run | RunList => {
                // pflag: the last value wins; a list flag appends.
                if target == Run {
                    run.retain(|(f, _)| f != flag);
                }
                let value = if kind == Bool { parse_bool(flag, &value)?.to_string() } else { value };
                run.push((flag.to_string(), value));
            }
            Unused => {
                if !extras.unused.iter().any(|u| u == flag) {
                    extras.unused.push(flag.to_string());
                }
            }
            Extra => match flag {
                "write-config-to" => action = Action::WriteConfigTo(value),
                "cleanup" if parse_bool(flag, &value)? => action = Action::Cleanup,
                "init-only" if parse_bool(flag, &value)? => action = Action::InitOnly,
                "version" if value == "raw" || parse_bool(flag, &value)? => action = Action::Version,
                "help" if parse_bool(flag, &value)? => action = Action::Help,
                "cleanup" | "init-only" | "version" | "help" => {}
                "feature-gates" => parse_gates(&value, &mut extras.feature_gates)?,
                "log-text-split-stream"
                | "log-json-split-stream"
                | "log-text-info-buffer-size"
                | "log-json-info-buffer-size" => {
                    let (format, option) = flag.trim_start_matches("log-").split_once('-').unwrap_or(("", ""));
                    let field = if option == "split-stream" { "splitStream" } else { "infoBufferSize" };
                    let value = if kind == Bool { parse_bool(flag, &value)?.to_string() } else { value };
                    extras.logging_options.retain(|(f, _)| *f != format!("{format}.{field}"));
                    extras.logging_options.push((format!("{format}.{field}"), value));
                    if !extras.unused.iter().any(|u| u == flag) {
                        extras.unused.push(flag.to_string());
                    }
                }
                "master" => extras.master = Some(value).filter(|m| !m.is_empty()),
                "proxy-mode" => extras.mode = Some(value),
                "oom-score-adj" => extras.oom_score_adj = Some(parse_int(flag, &value)?),
                "healthz-port" => extras.healthz_port = Some(parse_int(flag, &value)?),
                "metrics-port" => extras.metrics_port = Some(parse_int(flag, &value)?),
                "iptables-masquerade-bit" => extras.iptables_masquerade_bit = Some(parse_int(flag, &value)?),
                "iptables-sync-period" => extras.iptables_periods.0 = Some(parse_duration(flag, &value)?),
                "iptables-min-sync-period" => extras.iptables_periods.1 = Some(parse_duration(flag, &value)?),
                "ipvs-sync-period" => extras.ipvs_periods.0 = Some(parse_duration(flag, &value)?),
                "ipvs-min-sync-period" => extras.ipvs_periods.1 = Some(parse_duration(flag, &value)?),
                "v" => {
                    let v = value.parse::<u32>().map_err(|_| FlagError::InvalidArgument {
                        flag: "v".into(),
                        value: value.clone(),
                        why: format!("strconv.ParseUint: parsing {value:?}: invalid syntax"),
                    })?;
                    extras.verbosity = Some(v);
                }
                _ => {}
            },
        }
    }
    let mut out: Vec<OsString> = vec![argv.first().cloned().unwrap_or_else(|| "nftproxy".into())];
    let verbose = verbosity_count(extras.verbosity.unwrap_or(0));
    out.extend(std::iter::repeat_n(OsString::from("-v"), usize::from(verbose)));
    out.push(match &action {
        Action::InitOnly => "conntrack-sysctls".into(),
        _ => "run".into(),
    });
    for (flag, value) in run {
        // conntrack-sysctls takes the config file and the conntrack flags only.
        if action == Action::InitOnly && !(flag == "config" || flag.starts_with("conntrack-")) {
            continue;
        }
        out.push(format!("--{flag}={value}").into());
    }
    Ok(Translated { argv: out, extras, action })
}

/// klog's verbosity as `-v` counts: 0 up to 3, 1 (debug) for 4 and 5, 2 (trace) from 6.
pub fn verbosity_count(v: u32) -> u8 {
    match v {
        0..=3 => 0,
        4 | 5 => 1,
        _ => 2,
    }
}

/// The `--version` lines: kube-proxy's, then nftproxy's own.
pub fn version_lines() -> String {
    format!(
        "Kubernetes {KUBE_PROXY_VERSION}\nnftproxy {} (kube-proxy {KUBE_PROXY_VERSION} compatible, nftables mode)\n",
        env!("CARGO_PKG_VERSION")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    fn run_args(t: &Translated) -> Vec<String> {
        t.argv.iter().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    #[test]
    fn kubeadms_command_line_runs() {
        let t = translate(&argv(&[
            "/usr/local/bin/kube-proxy",
            "--config=/var/lib/kube-proxy/config.conf",
            "--hostname-override=node1",
        ]))
        .unwrap();
        assert_eq!(t.action, Action::Run);
        assert_eq!(
            run_args(&t),
            [
                "/usr/local/bin/kube-proxy",
                "run",
                "--config=/var/lib/kube-proxy/config.conf",
                "--hostname-override=node1"
            ]
        );
        assert!(t.extras.given.is_empty() && t.extras.unused.is_empty());
    }

    #[test]
    fn pflag_syntax_in_every_form() {
        let t = translate(&argv(&[
            "kube-proxy",
            "--cluster-cidr",
            "10.0.0.0/8",
            "--masquerade-all",
            "--conntrack-tcp-be-liberal=false",
            "-v=4",
            "--nodeport-addresses=primary",
            "--nodeport-addresses",
            "10.0.0.0/8",
            "--feature-gates=A=true,B=false",
            "--proxy-mode",
            "iptables",
            "--iptables-sync-period=1m",
            "--healthz-port=0",
            "--profiling",
            "--ipvs-scheduler=rr",
            "--cluster-cidr=10.1.0.0/16",
        ]))
        .unwrap();
        assert_eq!(
            run_args(&t),
            [
                "kube-proxy",
                "-v",
                "run",
                "--masquerade-all=true",
                "--conntrack-tcp-be-liberal=false",
                "--nodeport-addresses=primary",
                "--nodeport-addresses=10.0.0.0/8",
                "--cluster-cidr=10.1.0.0/16",
            ]
        );
        let x = &t.extras;
        assert_eq!(x.verbosity, Some(4));
        assert_eq!(x.mode.as_deref(), Some("iptables"));
        assert_eq!(x.iptables_periods.0, Some(GoDuration::from_secs(60)));
        assert_eq!(x.healthz_port, Some(0));
        assert_eq!(x.feature_gates.get("B"), Some(&false));
        assert_eq!(x.unused, ["profiling", "ipvs-scheduler"]);
        assert!(x.given.contains(&"cluster-cidr".to_string()) && x.given.contains(&"proxy-mode".to_string()));
        assert_eq!(translate(&argv(&["kube-proxy", "-v2"])).unwrap().extras.verbosity, Some(2));
        assert_eq!(translate(&argv(&["kube-proxy", "-v", "6"])).unwrap().argv.len(), 4);
    }

    #[test]
    fn one_shot_actions() {
        assert_eq!(translate(&argv(&["kube-proxy", "--version"])).unwrap().action, Action::Version);
        assert_eq!(translate(&argv(&["kube-proxy", "--version=raw"])).unwrap().action, Action::Version);
        assert_eq!(translate(&argv(&["kube-proxy", "--version=false"])).unwrap().action, Action::Run);
        assert_eq!(translate(&argv(&["kube-proxy", "-h"])).unwrap().action, Action::Help);
        assert_eq!(translate(&argv(&["kube-proxy", "--cleanup"])).unwrap().action, Action::Cleanup);
        let init =
            translate(&argv(&["kube-proxy", "--init-only", "--config=c", "--cluster-cidr=x", "--conntrack-min=5"]))
                .unwrap();
        assert_eq!(init.action, Action::InitOnly);
        assert_eq!(run_args(&init), ["kube-proxy", "conntrack-sysctls", "--config=c", "--conntrack-min=5"]);
        let w = translate(&argv(&["kube-proxy", "--write-config-to", "/tmp/x"])).unwrap();
        assert_eq!(w.action, Action::WriteConfigTo("/tmp/x".into()));
    }

    #[test]
    fn refused_as_kube_proxy_refuses() {
        let cases: [(&[&str], FlagError); 6] = [
            (&["kube-proxy", "--nope"], FlagError::Unknown("nope".into())),
            (&["kube-proxy", "-x"], FlagError::UnknownShorthand('x')),
            (&["kube-proxy", "--config"], FlagError::NeedsArgument("config".into())),
            (&["kube-proxy", "stray"], FlagError::Positional(vec!["stray".into()])),
            (
                &["kube-proxy", "--masquerade-all=maybe"],
                FlagError::InvalidArgument {
                    flag: "masquerade-all".into(),
                    value: "maybe".into(),
                    why: "strconv.ParseBool: parsing \"maybe\": invalid syntax".into(),
                },
            ),
            (
                &["kube-proxy", "--iptables-sync-period=soon"],
                FlagError::InvalidArgument {
                    flag: "iptables-sync-period".into(),
                    value: "soon".into(),
                    why: "time: invalid duration \"soon\"".into(),
                },
            ),
        ];
        for (args, err) in cases {
            assert_eq!(translate(&argv(args)), Err(err), "{args:?}");
        }
        assert_eq!(FlagError::Unknown("nope".into()).to_string(), "unknown flag: --nope", "pflag's message");
    }

    #[test]
    fn who_is_kube_proxy() {
        assert!(is_kube_proxy(&argv(&["/usr/local/bin/kube-proxy"])));
        assert!(is_kube_proxy(&argv(&["kube-proxy", "--version"])));
        assert!(is_kube_proxy(&argv(&["nftproxy", "--config=/x"])));
        assert!(is_kube_proxy(&argv(&["nftproxy", "--v=2", "--kubeconfig", "/k"])));
        assert!(!is_kube_proxy(&argv(&["nftproxy"])));
        assert!(!is_kube_proxy(&argv(&["nftproxy", "--help"])));
        assert!(!is_kube_proxy(&argv(&["nftproxy", "-v", "run", "--config=/x"])));
        assert!(!is_kube_proxy(&argv(&["nftproxy", "--logging-format=json", "run"])));
        assert!(!is_kube_proxy(&argv(&["nftproxy", "render", "--manifests", "x"])));
    }

    #[test]
    fn every_flag_is_known_once() {
        let mut names: Vec<&str> = FLAGS.iter().map(|f| f.0).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len());
        for f in FILE_WINS {
            assert!(names.contains(f), "{f}");
        }
    }
}
