//! What more than one of this crate's test binaries uses (each includes it with `mod common`).

/// vesseld's metrics exposition, read as Prometheus reads it: a text-format parser, not
/// string matching.
pub struct Metrics {
    body: String,
    scrape: prometheus_parse::Scrape,
}

impl Metrics {
    pub fn parse(body: String) -> Metrics {
        let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
            .expect("the exposition parses");
        Metrics { body, scrape }
    }

    /// The value of the sample `name` with (at least) `labels` (a histogram's count);
    /// panics, showing the exposition, when there is none.
    pub fn want(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.scrape
            .samples
            .iter()
            .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .map(|s| match &s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => *v,
                prometheus_parse::Value::Histogram(b) => b.last().map_or(0.0, |b| b.count),
                prometheus_parse::Value::Summary(_) => f64::NAN,
            })
            .unwrap_or_else(|| panic!("{name} {labels:?} not in:\n{}", self.body))
    }
}
