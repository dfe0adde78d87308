//! Arrival processes: Poisson at a rate, a stepped Poisson ramp, or closed-loop concurrency.

use std::str::FromStr;
use std::time::Duration;

use serde::Serialize;

/// When requests are sent.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Arrival {
    /// Open loop: exponential gaps at `rate` requests/s.
    Poisson { rate: f64 },
    /// Open loop: Poisson whose rate steps linearly from `from` to `to` in `steps` steps of
    /// `step_secs` each; sending stops when the last step ends.
    Ramp {
        from: f64,
        to: f64,
        steps: u32,
        step_secs: f64,
    },
    /// Closed loop: `concurrency` clients, each sending its next request when one ends.
    Closed { concurrency: usize },
}

impl Arrival {
    /// The same process with every rate multiplied by `k` and every duration divided by `k`
    /// (used to express a ramp in simulated time against a sped-up simulator).
    pub fn scaled(&self, k: f64) -> Arrival {
        match *self {
            Arrival::Poisson { rate } => Arrival::Poisson { rate: rate * k },
            Arrival::Ramp {
                from,
                to,
                steps,
                step_secs,
            } => Arrival::Ramp {
                from: from * k,
                to: to * k,
                steps,
                step_secs: step_secs / k,
            },
            Arrival::Closed { concurrency } => Arrival::Closed { concurrency },
        }
    }

    /// Rate during step `k` of a ramp.
    fn step_rate(from: f64, to: f64, steps: u32, k: u32) -> f64 {
        if steps <= 1 {
            from
        } else {
            from + (to - from) * f64::from(k) / f64::from(steps - 1)
        }
    }

    /// Total length of a ramp (`None` for processes without an end of their own).
    pub fn natural_duration(&self) -> Option<Duration> {
        match *self {
            Arrival::Ramp {
                steps, step_secs, ..
            } => Some(Duration::from_secs_f64(f64::from(steps) * step_secs)),
            _ => None,
        }
    }
}

/// Parses `FROM:TO:STEPS` (the step length comes from elsewhere).
pub fn parse_ramp(s: &str) -> Result<(f64, f64, u32), String> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 3 {
        return Err(format!("expected FROM:TO:STEPS, got {s:?}"));
    }
    let from = f64::from_str(parts[0]).map_err(|e| format!("ramp FROM: {e}"))?;
    let to = f64::from_str(parts[1]).map_err(|e| format!("ramp TO: {e}"))?;
    let steps = u32::from_str(parts[2]).map_err(|e| format!("ramp STEPS: {e}"))?;
    if !(from > 0.0 && to > 0.0 && from.is_finite() && to.is_finite()) || steps == 0 {
        return Err(format!("ramp rates must be > 0 and steps ≥ 1, got {s:?}"));
    }
    Ok((from, to, steps))
}

/// Send times (offsets from the start) of an open-loop process; seeded.
pub struct Schedule {
    arrival: Arrival,
    rng: fastrand::Rng,
    t: f64,
}

impl Schedule {
    pub fn new(arrival: Arrival, seed: u64) -> Self {
        Schedule {
            arrival,
            rng: fastrand::Rng::with_seed(seed ^ 0xa076_1d64_78bd_642f),
            t: 0.0,
        }
    }

    fn exp(&mut self, rate: f64) -> f64 {
        // 1 − u is in (0, 1], so the logarithm is finite.
        -(1.0 - self.rng.f64()).ln() / rate
    }
}

impl Iterator for Schedule {
    type Item = Duration;

    /// The next send time, or `None` when the process has ended (or is closed-loop).
    fn next(&mut self) -> Option<Duration> {
        match self.arrival {
            Arrival::Closed { .. } => None,
            Arrival::Poisson { rate } => {
                if rate.is_nan() || rate <= 0.0 {
                    return None;
                }
                self.t += self.exp(rate);
                Some(Duration::from_secs_f64(self.t))
            }
            Arrival::Ramp {
                from,
                to,
                steps,
                step_secs,
            } => loop {
                let k = (self.t / step_secs).floor() as u32;
                if k >= steps {
                    return None;
                }
                let rate = Arrival::step_rate(from, to, steps, k);
                let next = self.t + self.exp(rate);
                let boundary = f64::from(k + 1) * step_secs;
                if next < boundary {
                    self.t = next;
                    return Some(Duration::from_secs_f64(next));
                }
                // Memoryless: restart the draw at the boundary with the next step's rate.
                self.t = boundary;
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn poisson_has_the_requested_rate_and_is_seeded() {
        let a: Vec<Duration> = Schedule::new(Arrival::Poisson { rate: 50.0 }, 1)
            .take(5000)
            .collect();
        let b: Vec<Duration> = Schedule::new(Arrival::Poisson { rate: 50.0 }, 1)
            .take(5000)
            .collect();
        assert_eq!(a, b);
        let rate = 5000.0 / a[4999].as_secs_f64();
        assert!((45.0..55.0).contains(&rate), "{rate}");
    }

    #[test]
    fn ramp_steps_up_and_ends() {
        let ramp = Arrival::Ramp {
            from: 10.0,
            to: 100.0,
            steps: 4,
            step_secs: 5.0,
        };
        let times: Vec<f64> = Schedule::new(ramp.clone(), 3)
            .map(|d| d.as_secs_f64())
            .collect();
        assert!(times.iter().all(|&t| t < 20.0));
        let first = times.iter().filter(|&&t| t < 5.0).count();
        let last = times.iter().filter(|&&t| t >= 15.0).count();
        assert!(first > 30 && first < 75, "{first}");
        assert!(last > 420 && last < 580, "{last}");
        assert_eq!(ramp.natural_duration(), Some(Duration::from_secs(20)));
        assert_eq!(parse_ramp("3:60:6").unwrap(), (3.0, 60.0, 6));
        assert!(parse_ramp("3:60").is_err());
        let fast = ramp.scaled(10.0);
        assert_eq!(fast.natural_duration(), Some(Duration::from_secs(2)));
    }
}
