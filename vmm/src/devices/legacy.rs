//! Legacy port-I/O devices: the 16550 UART on COM1 (vm-superio), the i8042 controller (only its
//! CPU-reset command matters, and it ends the VM), the CMOS RTC (reads answer 0: a guest that
//! polls the RTC's update-in-progress bit or the CMOS otherwise spins for seconds under nested
//! virtualisation), and a sink for everything else (reads as all ones, writes ignored).

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use vm_superio::{I8042Device, Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::run_state::{Control, Outcome};

/// COM1.
pub const SERIAL_PORT: u16 = 0x3f8;
/// COM1's interrupt line (ISA IRQ 4).
pub const SERIAL_IRQ: u32 = 4;
const I8042_PORT: u16 = 0x60;
const RTC_PORT: u16 = 0x70;

/// A `Trigger` that signals an `EventFd` (registered as an irqfd for the serial port).
pub struct EventFdTrigger(pub EventFd);

impl Trigger for EventFdTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// The i8042's reset line: ends the VM with [`Outcome::Reboot`].
pub struct ResetTrigger(pub Arc<Control>);

impl Trigger for ResetTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.finish(Outcome::Reboot);
        Ok(())
    }
}

/// Kernel messages that tell the guest's outcome, printed at emergency level (so they appear
/// even with `quiet`): without ACPI a powered-off or halted kernel just stops, so the console
/// is the only witness.
const MARKERS: [(&str, Outcome); 3] = [
    ("Kernel panic - not syncing", Outcome::Panic),
    ("reboot: Power down", Outcome::Poweroff),
    ("reboot: System halted", Outcome::Poweroff),
];

/// The serial console's sink: writes to a file or nowhere, and watches lines for the markers
/// above and for `marker_prefix` lines a test guest prints (their arrival times are recorded).
pub struct ConsoleSink {
    out: Option<Box<dyn Write + Send>>,
    line: Vec<u8>,
    control: Arc<Control>,
}

impl ConsoleSink {
    pub fn new(out: Option<Box<dyn Write + Send>>, control: Arc<Control>) -> Self {
        ConsoleSink {
            out,
            line: Vec::with_capacity(256),
            control,
        }
    }

    fn end_line(&mut self) {
        let line = String::from_utf8_lossy(&self.line);
        for (m, outcome) in MARKERS.iter() {
            if line.contains(m) {
                self.control.finish(outcome.clone());
            }
        }
        if let Some(rest) = line.split("vessel-event: ").nth(1) {
            self.control.event(rest.trim().to_string(), Instant::now());
        }
        self.line.clear();
    }
}

impl Write for ConsoleSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for b in buf {
            if *b == b'\n' {
                self.end_line();
            } else if self.line.len() < 4096 {
                self.line.push(*b);
            }
        }
        if let Some(o) = self.out.as_mut() {
            o.write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if let Some(o) = self.out.as_mut() {
            o.flush()?;
        }
        Ok(())
    }
}

/// The port-I/O bus.
pub struct PioBus {
    pub serial: Mutex<Serial<EventFdTrigger, vm_superio::serial::NoEvents, ConsoleSink>>,
    i8042: Mutex<I8042Device<ResetTrigger>>,
    rtc_index: Mutex<u8>,
}

impl PioBus {
    pub fn new(serial_irq: EventFd, console: ConsoleSink, control: Arc<Control>) -> Self {
        PioBus {
            serial: Mutex::new(Serial::new(EventFdTrigger(serial_irq), console)),
            i8042: Mutex::new(I8042Device::new(ResetTrigger(control))),
            rtc_index: Mutex::new(0),
        }
    }

    /// Feeds bytes to the guest as if typed on the serial console (raises the receive
    /// interrupt when the guest enabled it). Returns how many fitted in the FIFO.
    pub fn console_input(&self, bytes: &[u8]) -> usize {
        lock(&self.serial).enqueue_raw_bytes(bytes).unwrap_or(0)
    }

    /// Handles an `IN` from `port`, filling `data`.
    pub fn read(&self, port: u16, data: &mut [u8]) {
        // The offsets fit a u8: 0..=7 from SERIAL_PORT, 0 or 4 from I8042_PORT (the arms).
        #[allow(clippy::cast_possible_truncation)]
        let v = match port {
            SERIAL_PORT..=0x3ff => lock(&self.serial).read((port - SERIAL_PORT) as u8),
            // 0x64 status: nothing to read, input buffer empty; 0x60 data: 0.
            I8042_PORT | 0x64 => lock(&self.i8042).read((port - I8042_PORT) as u8),
            // RTC index and data: 0 everywhere (update-in-progress clear, time "00:00:00").
            RTC_PORT | 0x71 => 0,
            _ => {
                data.fill(0xff);
                return;
            }
        };
        data.fill(0);
        data[0] = v;
    }

    /// Handles an `OUT` of `data` to `port`.
    pub fn write(&self, port: u16, data: &[u8]) {
        let Some(&v) = data.first() else { return };
        // The offsets fit a u8: 0..=7 from SERIAL_PORT, 0 or 4 from I8042_PORT (the arms).
        #[allow(clippy::cast_possible_truncation)]
        match port {
            SERIAL_PORT..=0x3ff => {
                if let Err(e) = lock(&self.serial).write((port - SERIAL_PORT) as u8, v) {
                    tracing::debug!("serial write: {e:?}");
                }
            }
            I8042_PORT | 0x64 => {
                let _ = lock(&self.i8042).write((port - I8042_PORT) as u8, v);
            }
            RTC_PORT => *lock(&self.rtc_index) = v & 0x7f,
            _ => {}
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bus() -> (PioBus, Arc<Control>, EventFd) {
        let control = Arc::new(Control::default());
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let sink = ConsoleSink::new(None, control.clone());
        (
            PioBus::new(irq.try_clone().unwrap(), sink, control.clone()),
            control,
            irq,
        )
    }

    #[test]
    fn i8042_reset_ends_vm_as_reboot() {
        let (bus, control, _) = bus();
        let mut st = [0xaau8];
        bus.read(0x64, &mut st);
        assert_eq!(st[0], 0);
        bus.write(0x64, &[0xfe]);
        assert_eq!(control.outcome(), Some(Outcome::Reboot));
    }

    #[test]
    fn console_input_reaches_the_receive_register() {
        let (bus, _, irq) = bus();
        // Enable the received-data interrupt (IER bit 0), then type.
        bus.write(SERIAL_PORT + 1, &[0x01]);
        assert_eq!(bus.console_input(b"ok\n"), 3);
        assert!(irq.read().unwrap() >= 1);
        let mut lsr = [0u8];
        bus.read(SERIAL_PORT + 5, &mut lsr);
        assert_eq!(lsr[0] & 1, 1, "data ready");
        let mut c = [0u8];
        bus.read(SERIAL_PORT, &mut c);
        assert_eq!(c[0], b'o');
    }

    #[test]
    fn rtc_reads_zero_and_unknown_ports_all_ones() {
        let (bus, _, _) = bus();
        bus.write(0x70, &[0x0a]);
        let mut d = [0xffu8];
        bus.read(0x71, &mut d);
        assert_eq!(d[0], 0);
        let mut w = [0u8; 2];
        bus.read(0xcfc, &mut w);
        assert_eq!(w, [0xff, 0xff]);
    }

    #[test]
    fn serial_output_markers_and_interrupt() {
        let (bus, control, irq) = bus();
        // Enable the THR-empty interrupt (IER bit 1), then write bytes.
        bus.write(SERIAL_PORT + 1, &[0x02]);
        for b in b"vessel-event: init\n[ 1.0] Kernel panic - not syncing: Attempted to kill init!\n"
        {
            bus.write(SERIAL_PORT, &[*b]);
        }
        assert!(irq.read().unwrap() >= 1);
        assert_eq!(control.outcome(), Some(Outcome::Panic));
        assert!(control.events().iter().any(|(n, _)| n == "init"));
    }
}
