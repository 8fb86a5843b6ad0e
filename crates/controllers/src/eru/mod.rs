mod cron; pub use cron::{Schedule, time_zone};
