//! [`HealthP2cLayer`]: builds a [`HealthP2c`] over a [`Sources`] set.

use pgw_core::OkIsSuccess;
use tower_layer::Layer;

use crate::{BalanceConfig, ConfigError, HealthP2c, Sources};

/// A [`Layer`] turning a [`Sources`] set into a [`HealthP2c`] balancer, for
/// `tower::ServiceBuilder` stacks (the retry layer goes above it).
#[derive(Clone, Debug)]
pub struct HealthP2cLayer<C = OkIsSuccess> {
    config: BalanceConfig,
    classifier: C,
    seed: Option<u64>,
}

impl HealthP2cLayer {
    /// A layer with `config`, classifying with [`OkIsSuccess`].
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad field.
    pub fn new(config: BalanceConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            config,
            classifier: OkIsSuccess,
            seed: None,
        })
    }
}

impl<C> HealthP2cLayer<C> {
    /// Classifies outcomes with `classifier`.
    #[must_use]
    pub fn with_classifier<C2>(self, classifier: C2) -> HealthP2cLayer<C2> {
        HealthP2cLayer {
            config: self.config,
            classifier,
            seed: self.seed,
        }
    }

    /// Seeds the balancer's random choices (reproducible runs).
    #[must_use]
    pub const fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }
}

impl<S, C: Clone> Layer<Sources<S>> for HealthP2cLayer<C> {
    type Service = HealthP2c<S, C>;

    fn layer(&self, sources: Sources<S>) -> Self::Service {
        let balancer = HealthP2c::from_valid(sources, self.config).with_classifier(self.classifier.clone());
        match self.seed {
            Some(seed) => balancer.with_seed(seed),
            None => balancer,
        }
    }
}
