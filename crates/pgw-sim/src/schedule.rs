//! [`Schedule`]: a configuration value that changes over scenario time (phases, flaps,
//! ramps), and [`Lerp`], how a ramp interpolates it.
//!
//! Time is scenario seconds since the pool's start (the tokio clock's elapsed time
//! divided by [`PoolConfig::time_scale`](crate::PoolConfig::time_scale)). The pool
//! evaluates every schedule of a source once per request, at its arrival.

use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, config_error};

/// A value over scenario time.
///
/// In JSON (or TOML) a plain value is a constant and serialises back as the plain value,
/// so every configuration written before schedules existed still loads and round-trips.
/// The other forms are one-key objects:
///
/// ```
/// use pgw_sim::Schedule;
///
/// // A constant.
/// let c: Schedule<f64> = serde_json::from_str("0.1").unwrap();
/// assert_eq!(c, Schedule::constant(0.1));
/// assert_eq!(serde_json::to_string(&c).unwrap(), "0.1");
///
/// // Phases: the value of the last phase that has begun (the first one before it).
/// let p: Schedule<f64> =
///     serde_json::from_str(r#"{"phases": [{"from_s": 0, "value": 0.0}, {"from_s": 600, "value": 1.0}]}"#).unwrap();
/// assert_eq!((p.at(599.9), p.at(600.0)), (0.0, 1.0));
///
/// // A flap: `on` for the first `duty * period_s` seconds of each period from `start_s`.
/// let f: Schedule<bool> =
///     serde_json::from_str(r#"{"flap": {"period_s": 60, "duty": 0.25, "on": true, "off": false}}"#).unwrap();
/// assert_eq!((f.at(14.9), f.at(15.0), f.at(60.0)), (true, false, true));
///
/// // A ramp: `from` before `from_s`, `to` after `to_s`, linear between.
/// let r: Schedule<f64> =
///     serde_json::from_str(r#"{"ramp": {"from_s": 100, "to_s": 200, "from": 0.0, "to": 0.5}}"#).unwrap();
/// assert_eq!((r.at(0.0), r.at(150.0), r.at(1e9)), (0.0, 0.25, 0.5));
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Schedule<T> {
    /// Piecewise constant: the value of the last phase whose `from_s` is at or before
    /// the time; before the first phase, the first phase's value.
    Phases {
        /// The phases, sorted by `from_s` (at least one).
        phases: Vec<Phase<T>>,
    },
    /// Alternates between two values.
    Flap {
        /// The flap's shape.
        flap: Flap<T>,
    },
    /// Moves linearly from one value to another.
    Ramp {
        /// The ramp's shape.
        ramp: Ramp<T>,
    },
    /// The same value at every instant (written as the plain value).
    Constant(T),
}

/// One phase of [`Schedule::Phases`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Phase<T> {
    /// Scenario second the phase begins.
    pub from_s: f64,
    /// The value from then on (until the next phase).
    pub value: T,
}

/// The shape of [`Schedule::Flap`]: `on` during the first `duty * period_s` seconds of
/// every period counted from `start_s`, `off` the rest of the period and before `start_s`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Flap<T> {
    /// Length of one period, seconds (`> 0`).
    pub period_s: f64,
    /// Fraction of each period spent `on` (`0..=1`).
    pub duty: f64,
    /// The value during the first part of each period.
    pub on: T,
    /// The value during the rest of each period.
    pub off: T,
    /// Scenario second the first period begins (default 0).
    #[serde(default)]
    pub start_s: f64,
}

/// The shape of [`Schedule::Ramp`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ramp<T> {
    /// Scenario second the ramp starts; `from` holds before it.
    pub from_s: f64,
    /// Scenario second the ramp ends (`>= from_s`); `to` holds from then on.
    pub to_s: f64,
    /// The value before the ramp.
    pub from: T,
    /// The value after the ramp.
    pub to: T,
}

/// How a [`Schedule::Ramp`] moves between two values.
///
/// Numbers interpolate linearly; structs of numbers componentwise; integers are
/// rounded; an `Option` is `None` only while both ends are `None` (a limit that one
/// end does not have is the other end's limit for the whole ramp). Types without a
/// meaningful interpolation (`bool`) keep `from` until the ramp's end, then `to`.
pub trait Lerp: Sized {
    /// The value a fraction `f` (`0 <= f < 1`) of the way from `from` to `to`.
    #[must_use]
    fn lerp(from: &Self, to: &Self, f: f64) -> Self;
}

impl Lerp for f64 {
    fn lerp(from: &Self, to: &Self, f: f64) -> Self {
        from + (to - from) * f
    }
}

impl Lerp for bool {
    /// `from` (a flag flips at the ramp's end).
    fn lerp(from: &Self, _to: &Self, _f: f64) -> Self {
        *from
    }
}

/// A rounded interpolation of two unsigned integers, in `f64` (exact below 2^53).
#[allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]
pub(crate) fn lerp_u64(from: u64, to: u64, f: f64) -> u64 {
    f64::lerp(&(from as f64), &(to as f64), f).round().max(0.0) as u64
}

impl Lerp for Option<u64> {
    fn lerp(from: &Self, to: &Self, f: f64) -> Self {
        match (*from, *to) {
            (Some(a), Some(b)) => Some(lerp_u64(a, b, f)),
            (one, None) | (None, one) => one,
        }
    }
}

impl Lerp for Option<u32> {
    fn lerp(from: &Self, to: &Self, f: f64) -> Self {
        let wide = Option::<u64>::lerp(&from.map(u64::from), &to.map(u64::from), f);
        wide.map(|v| u32::try_from(v).unwrap_or(u32::MAX))
    }
}

impl<T> Schedule<T> {
    /// A value that never changes.
    #[must_use]
    pub const fn constant(value: T) -> Self {
        Self::Constant(value)
    }

    /// The value at scenario second `t_s`.
    ///
    /// # Panics
    /// On [`Schedule::Phases`] with no phase, which validation rejects (a pool never
    /// holds one).
    #[must_use]
    pub fn at(&self, t_s: f64) -> T
    where
        T: Clone + Lerp,
    {
        match self {
            Self::Constant(v) => v.clone(),
            Self::Phases { phases } => phases
                .iter()
                .rev()
                .find(|p| p.from_s <= t_s)
                .or_else(|| phases.first())
                .map(|p| p.value.clone())
                .expect("a validated schedule has at least one phase"),
            Self::Flap { flap } => {
                let since = t_s - flap.start_s;
                // `since < 0` (before the start) and a NaN both read as `off`.
                if since >= 0.0 && since.rem_euclid(flap.period_s) < flap.duty * flap.period_s {
                    flap.on.clone()
                } else {
                    flap.off.clone()
                }
            }
            Self::Ramp { ramp } => {
                if t_s >= ramp.to_s {
                    ramp.to.clone()
                } else if t_s <= ramp.from_s {
                    ramp.from.clone()
                } else {
                    T::lerp(
                        &ramp.from,
                        &ramp.to,
                        (t_s - ramp.from_s) / (ramp.to_s - ramp.from_s),
                    )
                }
            }
        }
    }

    /// The constant value, if the schedule is one.
    #[must_use]
    pub const fn as_constant(&self) -> Option<&T> {
        match self {
            Self::Constant(v) => Some(v),
            _ => None,
        }
    }

    /// Every value the schedule names (a ramp's values in between are not listed).
    pub fn values(&self) -> impl Iterator<Item = &T> {
        let v: Vec<&T> = match self {
            Self::Constant(v) => vec![v],
            Self::Phases { phases } => phases.iter().map(|p| &p.value).collect(),
            Self::Flap { flap } => vec![&flap.on, &flap.off],
            Self::Ramp { ramp } => vec![&ramp.from, &ramp.to],
        };
        v.into_iter()
    }

    /// Every value the schedule names, mutably: changes a knob in every phase at once
    /// (`for c in account.rate_limit.values_mut() { c.rpm_slope = 0.005 }`).
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        let v: Vec<&mut T> = match self {
            Self::Constant(v) => vec![v],
            Self::Phases { phases } => phases.iter_mut().map(|p| &mut p.value).collect(),
            Self::Flap { flap } => vec![&mut flap.on, &mut flap.off],
            Self::Ramp { ramp } => vec![&mut ramp.from, &mut ramp.to],
        };
        v.into_iter()
    }

    /// Checks the schedule's shape and each value with `check` (called with the value
    /// and its path, e.g. `sources[2].server_error_rate.phases[1].value`).
    pub(crate) fn validate(
        &self,
        field: &str,
        check: impl Fn(&T, &str) -> Result<(), ConfigError>,
    ) -> Result<(), ConfigError> {
        let finite = |name: String, v: f64| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(config_error(name, "must be finite"))
            }
        };
        match self {
            Self::Constant(v) => check(v, field),
            Self::Phases { phases } => {
                if phases.is_empty() {
                    return Err(config_error(
                        format!("{field}.phases"),
                        "at least one phase is needed",
                    ));
                }
                let mut last = f64::NEG_INFINITY;
                for (i, p) in phases.iter().enumerate() {
                    let at = format!("{field}.phases[{i}]");
                    finite(format!("{at}.from_s"), p.from_s)?;
                    if p.from_s < last {
                        return Err(config_error(
                            format!("{at}.from_s"),
                            "phases must be sorted by from_s",
                        ));
                    }
                    last = p.from_s;
                    check(&p.value, &format!("{at}.value"))?;
                }
                Ok(())
            }
            Self::Flap { flap } => {
                let at = format!("{field}.flap");
                if !(flap.period_s.is_finite() && flap.period_s > 0.0) {
                    return Err(config_error(format!("{at}.period_s"), "must be finite and > 0"));
                }
                if !(0.0..=1.0).contains(&flap.duty) {
                    return Err(config_error(format!("{at}.duty"), "must be within [0, 1]"));
                }
                finite(format!("{at}.start_s"), flap.start_s)?;
                check(&flap.on, &format!("{at}.on"))?;
                check(&flap.off, &format!("{at}.off"))
            }
            Self::Ramp { ramp } => {
                let at = format!("{field}.ramp");
                finite(format!("{at}.from_s"), ramp.from_s)?;
                finite(format!("{at}.to_s"), ramp.to_s)?;
                if ramp.from_s > ramp.to_s {
                    return Err(config_error(format!("{at}.to_s"), "must be >= from_s"));
                }
                check(&ramp.from, &format!("{at}.from"))?;
                check(&ramp.to, &format!("{at}.to"))
            }
        }
    }
}

impl<T> From<T> for Schedule<T> {
    fn from(value: T) -> Self {
        Self::Constant(value)
    }
}

impl<T: Default> Default for Schedule<T> {
    fn default() -> Self {
        Self::Constant(T::default())
    }
}

/// `skip_serializing_if` for fields added after the first release: an absent knob stays
/// absent, so a configuration serialises as it did before the knob existed.
pub(crate) fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_before_first_and_at_boundaries() {
        let s = Schedule::Phases {
            phases: vec![
                Phase {
                    from_s: 10.0,
                    value: 1.0,
                },
                Phase {
                    from_s: 20.0,
                    value: 2.0,
                },
            ],
        };
        assert_eq!(s.at(0.0), 1.0);
        assert_eq!(s.at(19.999), 1.0);
        assert_eq!(s.at(20.0), 2.0);
    }

    #[test]
    fn flap_starts_off_before_start_and_repeats() {
        let s = Schedule::Flap {
            flap: Flap {
                period_s: 10.0,
                duty: 0.3,
                on: 1.0,
                off: 0.0,
                start_s: 100.0,
            },
        };
        assert_eq!(s.at(99.0), 0.0);
        assert_eq!(s.at(100.0), 1.0);
        assert_eq!(s.at(102.9), 1.0);
        assert_eq!(s.at(103.0), 0.0);
        assert_eq!(s.at(110.0), 1.0);
    }

    #[test]
    fn ramp_of_options_and_flags() {
        let r = Schedule::Ramp {
            ramp: Ramp {
                from_s: 0.0,
                to_s: 10.0,
                from: Some(100u64),
                to: Some(0),
            },
        };
        assert_eq!(r.at(2.5), Some(75));
        let half = Schedule::Ramp {
            ramp: Ramp {
                from_s: 0.0,
                to_s: 10.0,
                from: None,
                to: Some(7u32),
            },
        };
        assert_eq!(half.at(1.0), Some(7));
        let flag = Schedule::Ramp {
            ramp: Ramp {
                from_s: 0.0,
                to_s: 10.0,
                from: false,
                to: true,
            },
        };
        assert_eq!((flag.at(9.99), flag.at(10.0)), (false, true));
    }

    #[test]
    fn plain_values_roundtrip_as_plain_values() {
        fn back<T: Serialize + for<'de> Deserialize<'de>>(json: &str) -> String {
            serde_json::to_string(&serde_json::from_str::<Schedule<T>>(json).unwrap()).unwrap()
        }
        assert_eq!(back::<f64>("0.25"), "0.25");
        assert_eq!(back::<bool>("true"), "true");
        assert_eq!(back::<Option<u32>>("null"), "null");
        assert_eq!(back::<Option<u32>>("7"), "7");
        assert_eq!(
            serde_json::from_str::<Schedule<f64>>("1").unwrap(),
            Schedule::constant(1.0)
        );
    }

    #[test]
    fn validation_names_the_value_path() {
        let s: Schedule<f64> =
            serde_json::from_str(r#"{"phases": [{"from_s": 0, "value": 0.1}, {"from_s": 5, "value": 2.0}]}"#)
                .unwrap();
        let check = |v: &f64, f: &str| {
            if (0.0..=1.0).contains(v) {
                Ok(())
            } else {
                Err(config_error(f, "out of range"))
            }
        };
        assert_eq!(s.validate("x", check).unwrap_err().field(), "x.phases[1].value");
        let unsorted: Schedule<f64> =
            serde_json::from_str(r#"{"phases": [{"from_s": 5, "value": 0.1}, {"from_s": 0, "value": 0.2}]}"#)
                .unwrap();
        assert_eq!(
            unsorted.validate("x", check).unwrap_err().field(),
            "x.phases[1].from_s"
        );
        let flap: Schedule<f64> =
            serde_json::from_str(r#"{"flap": {"period_s": 0, "duty": 0.5, "on": 1.0, "off": 0.0}}"#).unwrap();
        assert_eq!(flap.validate("x", check).unwrap_err().field(), "x.flap.period_s");
        let ramp: Schedule<f64> =
            serde_json::from_str(r#"{"ramp": {"from_s": 5, "to_s": 1, "from": 1.0, "to": 0.0}}"#).unwrap();
        assert_eq!(ramp.validate("x", check).unwrap_err().field(), "x.ramp.to_s");
        let empty = Schedule::<f64>::Phases { phases: vec![] };
        assert_eq!(empty.validate("x", check).unwrap_err().field(), "x.phases");
    }
}
