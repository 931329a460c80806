// SPDX-License-Identifier: MIT
//! The safe crate on the CPU backend: accuracy against an fp64 token-by-token
//! recurrence on random inputs, plan reuse, and the error paths.

use flashkda::{
    build_info, from_bf16, query_device, to_bf16, version, version_string, Backend, BetaMode, CheckpointDestination, Conv,
    ConvStates, DecodePool, Dtype, Error, GateMode, HostCheckpoints, HostFwd, HostPool, HostTransitions, Indices, LayerStep,
    NullSlotRule, OutGate, Plan, PlanDesc, RawDecodeArgs, RawFwdArgs, RawLayerStep, RawTensor, SeqLens, StateMut, StateRef,
    Status, Values,
};
use flashkda_sys as sys;
use std::ffi::c_void;
use std::ptr::null_mut;

const DIM: usize = 128;
const BF16_NAN: u16 = 0x7FC0;

// -------------------------------------------------------------- randomness

/// SplitMix64 with Box-Muller normals: reproducible without any crate.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }

    fn bf16_normals(&mut self, n: usize) -> Vec<u16> {
        (0..n).map(|_| to_bf16(self.normal() as f32)).collect()
    }

    fn uniforms(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform() as f32).collect()
    }
}

// --------------------------------------------------------------- reference

/// A plan's gate and beta forms and the inputs a problem passes for them.
#[derive(Clone, Copy, Debug)]
struct Form {
    gate: GateMode,
    beta: BetaMode,
    /// g, beta as f32 instead of bf16.
    f32_g: bool,
    f32_beta: bool,
    /// A_log, dt_bias present.
    a_log: bool,
    dt_bias: bool,
}

const BOUNDED: Form =
    Form { gate: GateMode::Bounded, beta: BetaMode::Logits, f32_g: false, f32_beta: false, a_log: true, dt_bias: true };
const SOFTPLUS: Form = Form { gate: GateMode::Softplus, ..BOUNDED };
const LOG_DECAY_F32: Form = Form { gate: GateMode::LogDecay, f32_g: true, a_log: false, dt_bias: false, ..BOUNDED };

/// Every form the tests run, by name.
const FORMS: [(&str, Form); 6] = [
    ("bounded without A_log and dt_bias", Form { a_log: false, dt_bias: false, ..BOUNDED }),
    ("softplus", SOFTPLUS),
    ("softplus without dt_bias", Form { dt_bias: false, ..SOFTPLUS }),
    ("log-decay f32", LOG_DECAY_F32),
    ("log-decay bf16", Form { f32_g: false, ..LOG_DECAY_F32 }),
    ("probabilities f32", Form { beta: BetaMode::Probabilities, f32_beta: true, ..BOUNDED }),
];

#[derive(Clone)]
struct Problem {
    batch: usize,
    seq_len: usize,
    heads: usize,
    q: Vec<u16>,
    k: Vec<u16>,
    v: Vec<u16>,
    /// bf16 bits, unless `g_f32` holds the values.
    g: Vec<u16>,
    g_f32: Option<Vec<f32>>,
    beta: Vec<u16>,
    beta_f32: Option<Vec<f32>>,
    a_log: Option<Vec<f32>>,
    dt_bias: Option<Vec<f32>>,
    scale: f32,
    lower_bound: f32,
    gate_mode: GateMode,
    beta_mode: BetaMode,
    initial_state: Option<Vec<f32>>,
    cu_seqlens: Option<Vec<i64>>,
}

impl Problem {
    /// Inputs as in docs/BENCHMARKS.md: q, k, v, g, beta ~ N(0, 1) in bf16;
    /// A_log, dt_bias ~ U(0, 1); initial state ~ 0.1 N(0, 1).
    fn random(seed: u64, batch: usize, seq_len: usize, heads: usize, seq_lens: Option<&[usize]>, with_state: bool) -> Problem {
        Problem::random_in(BOUNDED, seed, batch, seq_len, heads, seq_lens, with_state)
    }

    /// `random`'s inputs changed for `form`: softplus gates take Kimi-Linear's
    /// parameters (A_log = ln U(1, 16), dt_bias the inverse softplus of
    /// log-uniform values in [0.001, 0.1]); log-decay gates g ~ N(-0.5, 0.5)
    /// itself (some above 0, read as 0); probabilities beta ~ U(-0.1, 1.1)
    /// (clamped into [0, 1]).
    fn random_in(
        form: Form,
        seed: u64,
        batch: usize,
        seq_len: usize,
        heads: usize,
        seq_lens: Option<&[usize]>,
        with_state: bool,
    ) -> Problem {
        let mut problem = Problem::draw(seed, batch, seq_len, heads, seq_lens, with_state);
        let mut rng = Rng(seed ^ 0x5EED);
        problem.gate_mode = form.gate;
        problem.beta_mode = form.beta;
        let mut g: Vec<f32> = problem.g.iter().map(|&x| from_bf16(x)).collect();
        let mut beta: Vec<f32> = problem.beta.iter().map(|&x| from_bf16(x)).collect();
        match form.gate {
            GateMode::Bounded => {}
            GateMode::Softplus => {
                problem.a_log = Some((0..heads).map(|_| (1.0 + 15.0 * rng.uniform()).ln() as f32).collect());
                let (low, high) = (1e-3f64.ln(), 1e-1f64.ln());
                problem.dt_bias = Some(
                    (0..heads * DIM)
                        .map(|_| ((low + (high - low) * rng.uniform()).exp().exp_m1()).ln() as f32)
                        .collect(),
                );
            }
            GateMode::LogDecay => {
                g = (0..g.len()).map(|_| (-0.5 + 0.5 * rng.normal()) as f32).collect();
            }
        }
        if form.beta == BetaMode::Probabilities {
            beta = (0..beta.len()).map(|_| (-0.1 + 1.2 * rng.uniform()) as f32).collect();
        }
        problem.g = g.iter().map(|&x| to_bf16(x)).collect();
        problem.g_f32 = form.f32_g.then_some(g);
        problem.beta = beta.iter().map(|&x| to_bf16(x)).collect();
        problem.beta_f32 = form.f32_beta.then_some(beta);
        if !form.a_log {
            problem.a_log = None;
        }
        if !form.dt_bias {
            problem.dt_bias = None;
        }
        problem
    }

    fn draw(seed: u64, batch: usize, seq_len: usize, heads: usize, seq_lens: Option<&[usize]>, with_state: bool) -> Problem {
        let mut rng = Rng(seed);
        let (batch, seq_len, cu_seqlens) = match seq_lens {
            Some(lengths) => {
                let mut offsets = vec![0i64];
                for &length in lengths {
                    offsets.push(offsets.last().unwrap() + length as i64);
                }
                (1, *offsets.last().unwrap() as usize, Some(offsets))
            }
            None => (batch, seq_len, None),
        };
        let num_seqs = cu_seqlens.as_ref().map_or(batch, |o| o.len() - 1);
        let tokens = batch * seq_len * heads;
        Problem {
            batch,
            seq_len,
            heads,
            q: rng.bf16_normals(tokens * DIM),
            k: rng.bf16_normals(tokens * DIM),
            v: rng.bf16_normals(tokens * DIM),
            g: rng.bf16_normals(tokens * DIM),
            g_f32: None,
            beta: rng.bf16_normals(tokens),
            beta_f32: None,
            a_log: Some(rng.uniforms(heads)),
            dt_bias: Some(rng.uniforms(heads * DIM)),
            scale: (DIM as f32).powf(-0.5),
            lower_bound: -5.0,
            gate_mode: GateMode::Bounded,
            beta_mode: BetaMode::Logits,
            initial_state: with_state
                .then(|| (0..num_seqs * heads * DIM * DIM).map(|_| (0.1 * rng.normal()) as f32).collect()),
            cu_seqlens,
        }
    }

    fn num_seqs(&self) -> usize {
        self.cu_seqlens.as_ref().map_or(self.batch, |o| o.len() - 1)
    }

    fn state_len(&self) -> usize {
        self.num_seqs() * self.heads * DIM * DIM
    }

    fn g_values(&self) -> Values<'_> {
        self.g_f32.as_deref().map_or(Values::Bf16(&self.g), Values::F32)
    }

    fn beta_values(&self) -> Values<'_> {
        self.beta_f32.as_deref().map_or(Values::Bf16(&self.beta), Values::F32)
    }

    fn g_at(&self, index: usize) -> f64 {
        self.g_f32.as_ref().map_or(from_bf16(self.g[index]), |g| g[index]) as f64
    }

    fn beta_at(&self, index: usize) -> f64 {
        self.beta_f32.as_ref().map_or(from_bf16(self.beta[index]), |b| b[index]) as f64
    }

    /// A CPU plan of the problem's forms.
    fn plan(&self) -> Plan {
        Plan::new(&PlanDesc {
            backend: Backend::Cpu,
            gate_mode: self.gate_mode,
            beta_mode: self.beta_mode,
            lower_bound: self.lower_bound,
            ..PlanDesc::new(self.heads as i32)
        })
        .expect("CPU plan")
    }

    /// The log-decays of head h for the gate input row `g` (header fkda_gate_mode).
    fn log_decays(&self, h: usize, g: &[f64]) -> Vec<f64> {
        let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
        let softplus = |x: f64| if x > 20.0 { x } else { x.exp().ln_1p() };
        let rate = self.a_log.as_ref().map_or(1.0, |a| (a[h] as f64).exp());
        let bias = |col: usize| self.dt_bias.as_ref().map_or(0.0, |d| d[h * DIM + col] as f64);
        (0..DIM)
            .map(|col| match self.gate_mode {
                GateMode::Bounded => self.lower_bound as f64 * sigmoid(rate * (g[col] + bias(col))),
                GateMode::Softplus => -rate * softplus(g[col] + bias(col)),
                GateMode::LogDecay => g[col].min(0.0),
            })
            .collect()
    }

    /// The delta rule's step size for a beta value (header fkda_beta_mode).
    fn step_size(&self, beta: f64) -> f64 {
        match self.beta_mode {
            BetaMode::Logits => 1.0 / (1.0 + (-beta).exp()),
            BetaMode::Probabilities => beta.clamp(0.0, 1.0),
        }
    }

    /// The token-by-token recurrence in f64: (out [B,T,H,V], final state [N,H,V,K]).
    fn reference(&self) -> (Vec<f64>, Vec<f64>) {
        let h_count = self.heads;
        let at = |b: usize, t: usize, h: usize| ((b * self.seq_len + t) * h_count + h) * DIM;
        let sequences: Vec<(usize, usize, usize)> = match &self.cu_seqlens {
            Some(o) => (0..o.len() - 1).map(|n| (0, o[n] as usize, o[n + 1] as usize)).collect(),
            None => (0..self.batch).map(|b| (b, 0, self.seq_len)).collect(),
        };
        let mut out = vec![0f64; self.batch * self.seq_len * h_count * DIM];
        let mut final_state = vec![0f64; self.state_len()];
        for (n, &(b, begin, end)) in sequences.iter().enumerate() {
            for h in 0..h_count {
                let state_at = (n * h_count + h) * DIM * DIM;
                let mut s: Vec<f64> = match &self.initial_state {
                    Some(init) => init[state_at..state_at + DIM * DIM].iter().map(|&x| x as f64).collect(),
                    None => vec![0f64; DIM * DIM],
                };
                for t in begin..end {
                    let base = at(b, t, h);
                    let read = |x: &[u16]| -> Vec<f64> { x[base..base + DIM].iter().map(|&e| from_bf16(e) as f64).collect() };
                    let (q, k, v) = (read(&self.q), read(&self.k), read(&self.v));
                    let g: Vec<f64> = (base..base + DIM).map(|i| self.g_at(i)).collect();
                    let norm = |x: &[f64]| (x.iter().map(|e| e * e).sum::<f64>() + 1e-6).sqrt();
                    let (q_norm, k_norm) = (norm(&q), norm(&k));
                    let q_hat: Vec<f64> = q.iter().map(|e| e / q_norm).collect();
                    let k_hat: Vec<f64> = k.iter().map(|e| e / k_norm).collect();
                    let b_t = self.step_size(self.beta_at((b * self.seq_len + t) * h_count + h));
                    let decays: Vec<f64> = self.log_decays(h, &g).iter().map(|a| a.exp()).collect();
                    for row in 0..DIM {
                        for col in 0..DIM {
                            s[row * DIM + col] *= decays[col];
                        }
                    }
                    for row in 0..DIM {
                        let predicted: f64 = (0..DIM).map(|col| s[row * DIM + col] * k_hat[col]).sum();
                        let correction = b_t * (v[row] - predicted);
                        for col in 0..DIM {
                            s[row * DIM + col] += correction * k_hat[col];
                        }
                    }
                    for row in 0..DIM {
                        let value: f64 = (0..DIM).map(|col| s[row * DIM + col] * q_hat[col]).sum();
                        out[base + row] = self.scale as f64 * value;
                    }
                }
                final_state[state_at..state_at + DIM * DIM].copy_from_slice(&s);
            }
        }
        (out, final_state)
    }

    /// The call's inputs over `out`, with no states and no offsets.
    fn inputs<'a>(&'a self, out: &'a mut [u16]) -> HostFwd<'a> {
        HostFwd {
            batch: self.batch,
            seq_len: self.seq_len,
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: self.g_values(),
            beta: self.beta_values(),
            a_log: self.a_log.as_deref(),
            dt_bias: self.dt_bias.as_deref(),
            scale: self.scale,
            out,
            initial_state: None,
            final_state: None,
            cu_seqlens: None,
        }
    }

    /// Runs the plan; outputs are poisoned first. Returns (out, final_state).
    fn run(&self, plan: &Plan) -> flashkda::Result<(Vec<u16>, Vec<f32>)> {
        let mut out = vec![BF16_NAN; self.q.len()];
        let mut state = vec![f32::NAN; self.state_len()];
        plan.fwd_host(
            HostFwd {
                initial_state: self.initial_state.as_deref().map(StateRef::F32),
                final_state: Some(StateMut::F32(&mut state)),
                cu_seqlens: self.cu_seqlens.as_deref().map(SeqLens::I64),
                ..self.inputs(&mut out)
            },
            None,
        )?;
        Ok((out, state))
    }
}

fn rel_l2(actual: impl Iterator<Item = f64>, expected: &[f64]) -> f64 {
    let (mut diff, mut norm) = (0f64, 0f64);
    for (a, e) in actual.zip(expected) {
        diff += (a - e) * (a - e);
        norm += e * e;
    }
    (diff / norm).sqrt()
}

fn assert_accurate(problem: &Problem, out: &[u16], state: &[f32]) {
    assert!(out.iter().all(|&x| !from_bf16(x).is_nan()), "out: some elements were not written");
    assert!(state.iter().all(|x| !x.is_nan()), "final_state: some elements were not written");
    let (expected_out, expected_state) = problem.reference();
    let out_error = rel_l2(out.iter().map(|&x| from_bf16(x) as f64), &expected_out);
    let state_error = rel_l2(state.iter().map(|&x| x as f64), &expected_state);
    assert!(out_error <= 6e-3, "out: relative L2 error {out_error:.3e}");
    assert!(state_error <= 5e-3, "final_state: relative L2 error {state_error:.3e}");
}

fn cpu_plan(heads: usize) -> Plan {
    Plan::new(&PlanDesc { backend: Backend::Cpu, ..PlanDesc::new(heads as i32) }).expect("CPU plan")
}

fn expect_invalid<T: std::fmt::Debug>(result: flashkda::Result<T>, argument: &str) -> Error {
    let error = result.expect_err("the call should fail");
    assert_eq!(error.status, Status::InvalidArgument, "{error}");
    assert!(
        error.message.starts_with(&format!("{argument}:")) || error.message.starts_with(&format!("desc.{argument}:")),
        "message does not name {argument}: {}",
        error.message
    );
    error
}

// ------------------------------------------------------------------- tests

#[test]
fn batched_forward_matches_the_recurrence() {
    let problem = Problem::random(11, 2, 37, 2, None, true);
    let plan = cpu_plan(2);
    assert_eq!(plan.backend().unwrap(), Backend::Cpu);
    let (out, state) = problem.run(&plan).unwrap();
    assert_accurate(&problem, &out, &state);
}

#[test]
fn varlen_forward_matches_the_recurrence() {
    let problem = Problem::random(12, 0, 0, 2, Some(&[19, 0, 35]), true);
    let (out, state) = problem.run(&cpu_plan(2)).unwrap();
    assert_accurate(&problem, &out, &state);
}

#[test]
fn bf16_state_and_i32_offsets() {
    let problem = Problem::random(13, 0, 0, 1, Some(&[20, 12]), true);
    let plan = Plan::new(&PlanDesc { backend: Backend::Cpu, state_dtype: Dtype::Bf16, ..PlanDesc::new(1) }).unwrap();
    let initial: Vec<u16> = problem.initial_state.as_ref().unwrap().iter().map(|&x| to_bf16(x)).collect();
    let offsets: Vec<i32> = problem.cu_seqlens.as_ref().unwrap().iter().map(|&x| x as i32).collect();
    let mut out = vec![BF16_NAN; problem.q.len()];
    let mut state = vec![BF16_NAN; problem.state_len()];
    plan.fwd_host(
        HostFwd {
            initial_state: Some(StateRef::Bf16(&initial)),
            final_state: Some(StateMut::Bf16(&mut state)),
            cu_seqlens: Some(SeqLens::I32(&offsets)),
            ..problem.inputs(&mut out)
        },
        None,
    )
    .unwrap();
    // The reference starts from the same bf16-rounded state.
    let reference_problem = Problem {
        initial_state: Some(initial.iter().map(|&x| from_bf16(x)).collect()),
        ..problem
    };
    let state_f32: Vec<f32> = state.iter().map(|&x| from_bf16(x)).collect();
    assert_accurate(&reference_problem, &out, &state_f32);
}

#[test]
fn plan_reuse_with_a_new_lower_bound() {
    let mut plan = cpu_plan(2);
    let first = Problem::random(14, 1, 40, 2, None, true);
    let (out_a, _) = first.run(&plan).unwrap();
    let (out_b, state_b) = first.run(&plan).unwrap();
    assert_eq!(out_a, out_b, "the same inputs give the same bits");
    assert_accurate(&first, &out_b, &state_b);

    plan.set_lower_bound(-2.0).unwrap();
    assert_eq!(plan.lower_bound().unwrap(), -2.0);
    let second = Problem { lower_bound: -2.0, ..Problem::random(15, 0, 0, 2, Some(&[7, 30]), true) };
    let (out, state) = second.run(&plan).unwrap();
    assert_accurate(&second, &out, &state);
}

#[test]
fn explicit_workspace_and_no_states() {
    let problem = Problem::random(16, 1, 20, 1, None, false);
    let plan = cpu_plan(1);
    let mut workspace = vec![0u8; plan.workspace_size(20, 1).unwrap() + 64];
    let mut out = vec![BF16_NAN; problem.q.len()];
    plan.fwd_host(
        HostFwd {
            ..problem.inputs(&mut out)
        },
        Some(&mut workspace),
    )
    .unwrap();
    let (expected, _) = problem.reference();
    assert!(out.iter().all(|&x| !from_bf16(x).is_nan()));
    assert!(rel_l2(out.iter().map(|&x| from_bf16(x) as f64), &expected) <= 6e-3);
}

#[test]
fn raw_forward_on_host_pointers_matches_fwd_host() {
    let problem = Problem::random(17, 1, 24, 2, None, true);
    let plan = cpu_plan(2);
    let (expected_out, expected_state) = problem.run(&plan).unwrap();
    let mut out = vec![BF16_NAN; problem.q.len()];
    let mut state = vec![f32::NAN; problem.state_len()];
    let activation = [1, 24, 2, DIM as i64];
    let tensor = |data: *const c_void, dtype: Dtype, shape: &[i64]| {
        RawTensor::new(data as *mut c_void, dtype, shape, None).unwrap()
    };
    let state_shape = [1, 2, DIM as i64, DIM as i64];
    let args = RawFwdArgs {
        q: tensor(problem.q.as_ptr().cast(), Dtype::Bf16, &activation),
        k: tensor(problem.k.as_ptr().cast(), Dtype::Bf16, &activation),
        v: tensor(problem.v.as_ptr().cast(), Dtype::Bf16, &activation),
        g: tensor(problem.g.as_ptr().cast(), Dtype::Bf16, &activation),
        beta: tensor(problem.beta.as_ptr().cast(), Dtype::Bf16, &activation[..3]),
        a_log: problem.a_log.as_ref().map(|a| tensor(a.as_ptr().cast(), Dtype::F32, &[2])),
        dt_bias: problem.dt_bias.as_ref().map(|d| tensor(d.as_ptr().cast(), Dtype::F32, &[2, DIM as i64])),
        out: tensor(out.as_mut_ptr().cast(), Dtype::Bf16, &activation),
        initial_state: Some(tensor(problem.initial_state.as_ref().unwrap().as_ptr().cast(), Dtype::F32, &state_shape)),
        final_state: Some(tensor(state.as_mut_ptr().cast(), Dtype::F32, &state_shape)),
        cu_seqlens: None,
        scale: problem.scale,
        pool: None,
        layer: None,
    };
    let mut workspace = vec![0u8; plan.workspace_size(24, 1).unwrap()];
    // SAFETY: every pointer is a live host buffer of the described shape.
    unsafe { plan.fwd_raw(&args, workspace.as_mut_ptr().cast(), workspace.len(), null_mut()) }.unwrap();
    assert_eq!(out, expected_out);
    assert_eq!(state, expected_state);

    let mut wrong = args;
    wrong.q.dtype = Dtype::F32;
    // SAFETY: as above; the library rejects the dtype before reading.
    let error = unsafe { plan.fwd_raw(&wrong, workspace.as_mut_ptr().cast(), workspace.len(), null_mut()) }.unwrap_err();
    assert_eq!(error.status, Status::InvalidArgument);
    assert!(error.message.starts_with("q:"), "{}", error.message);
}

#[test]
fn slice_lengths_are_checked_before_the_call() {
    let problem = Problem::random(18, 1, 16, 2, None, true);
    let plan = cpu_plan(2);
    let mut out = vec![0u16; problem.q.len()];
    let short_k = &problem.k[..problem.k.len() - 1];
    let result = plan.fwd_host(
        HostFwd {
            k: short_k,
            ..problem.inputs(&mut out)
        },
        None,
    );
    expect_invalid(result, "k");

    let mut short_state = vec![0f32; 10];
    let result = plan.fwd_host(
        HostFwd {
            final_state: Some(StateMut::F32(&mut short_state)),
            ..problem.inputs(&mut out)
        },
        None,
    );
    expect_invalid(result, "final_state");
}

#[test]
fn library_errors_carry_status_and_message() {
    let problem = Problem::random(19, 1, 16, 2, None, true);
    let plan = cpu_plan(2);
    let mut out = vec![0u16; problem.q.len()];
    let mut bf16_state = vec![0u16; problem.state_len()];
    // The plan's state dtype is f32.
    let result = plan.fwd_host(
        HostFwd {
            scale: f32::NAN,
            final_state: Some(StateMut::Bf16(&mut bf16_state)),
            ..problem.inputs(&mut out)
        },
        None,
    );
    let error = expect_invalid(result, "final_state");
    assert!(error.to_string().contains(Status::InvalidArgument.text()));

    let bad_offsets = [0i64, 9, 4, 16];
    let mut state = vec![0f32; 3 * 2 * DIM * DIM];
    let result = plan.fwd_host(
        HostFwd {
            final_state: Some(StateMut::F32(&mut state)),
            cu_seqlens: Some(SeqLens::I64(&bad_offsets)),
            ..problem.inputs(&mut out)
        },
        None,
    );
    expect_invalid(result, "cu_seqlens");

    let result = plan.fwd_host(
        HostFwd {
            scale: f32::INFINITY,
            ..problem.inputs(&mut out)
        },
        None,
    );
    expect_invalid(result, "scale");
}

#[test]
fn lower_bound_is_validated() {
    for bad in [-5.5f32, 0.25, f32::NAN, f32::NEG_INFINITY] {
        expect_invalid(Plan::new(&PlanDesc { backend: Backend::Cpu, lower_bound: bad, ..PlanDesc::new(1) }), "lower_bound");
        let mut plan = cpu_plan(1);
        expect_invalid(plan.set_lower_bound(bad), "lower_bound");
        assert_eq!(plan.lower_bound().unwrap(), -5.0);
    }
}

#[test]
fn plan_descriptions_are_validated() {
    expect_invalid(Plan::new(&PlanDesc { backend: Backend::Cpu, ..PlanDesc::new(0) }), "num_heads");
    expect_invalid(Plan::new(&PlanDesc { backend: Backend::Cpu, state_dtype: Dtype::I32, ..PlanDesc::new(1) }), "state_dtype");
    let unsupported = Plan::new(&PlanDesc { backend: Backend::Cpu, head_dim_k: 64, ..PlanDesc::new(1) }).unwrap_err();
    assert_eq!(unsupported.status, Status::Unsupported);
    assert!(unsupported.message.starts_with("desc.head_dim_k:"));
    let plan = cpu_plan(1);
    expect_invalid(plan.workspace_size(-1, 1), "total_tokens");
    expect_invalid(plan.workspace_size(1, -1), "num_seqs");
}

#[test]
fn gpu_plan_exactly_when_a_usable_device_is_present() {
    // Either outcome is asserted: a machine with a GPU must get a GPU plan,
    // one without must get the error that says why.
    let info = query_device(-1).unwrap();
    let requested = Plan::new(&PlanDesc { backend: Backend::Gpu, ..PlanDesc::new(1) });
    if info.device_count > 0 && info.has_kernels {
        let plan = requested.unwrap_or_else(|e| panic!("a device with kernels is present: {e}"));
        assert_eq!(plan.backend().unwrap(), Backend::Gpu);
        assert!(plan.workspace_size(64, 1).unwrap() > 0);
    } else {
        let error = requested.unwrap_err();
        assert!(matches!(error.status, Status::NoDevice | Status::UnsupportedArch), "{error}");
        assert!(error.message.starts_with("desc.backend:"), "{}", error.message);
    }
}

#[test]
fn raw_tensor_rank_is_checked() {
    let error = RawTensor::new(null_mut(), Dtype::F32, &[1; 7], None).unwrap_err();
    assert_eq!(error.status, Status::InvalidArgument);
    let tensor = RawTensor::new(null_mut(), Dtype::Bf16, &[2, 3, 4], None).unwrap();
    assert_eq!(tensor.strides(), &[12, 4, 1]);
    assert_eq!(tensor.shape(), &[2, 3, 4]);
}

#[test]
fn plans_are_send_and_dropped() {
    fn assert_send<T: Send>() {}
    assert_send::<Plan>();
    let plan = cpu_plan(3);
    let handle = std::thread::spawn(move || {
        let size = plan.workspace_size(10, 1).unwrap();
        drop(plan);
        size
    });
    handle.join().unwrap();
}

#[test]
fn build_info_names_the_kernels() {
    let info = build_info().unwrap();
    assert!(info.cuda_version >= info.min_driver_version && info.min_driver_version >= 12000);
    assert_eq!(info.min_driver_version % 1000, 0);
    assert!(info.architectures.split(' ').any(|arch| arch == "sm_80"), "{}", info.architectures);
}

#[test]
fn device_query_version_and_status_text() {
    let info = query_device(-1).unwrap();
    assert!(info.device_count >= 0);
    if !info.driver_loaded {
        assert_eq!(info.device_count, 0);
    }
    assert!(query_device(-2).is_err());
    assert_eq!(version(), flashkda_sys::FKDA_VERSION_NUMBER);
    assert_eq!(
        version_string(),
        format!(
            "{}.{}.{}",
            flashkda_sys::FKDA_VERSION_MAJOR,
            flashkda_sys::FKDA_VERSION_MINOR,
            flashkda_sys::FKDA_VERSION_PATCH
        )
    );
    assert_ne!(Status::InvalidArgument.text(), Status::NoDevice.text());
    assert_eq!(Status::from_raw(42), Status::Other(42));
    assert_eq!(Status::from_raw(Status::WorkspaceTooSmall.raw()), Status::WorkspaceTooSmall);
}

#[test]
fn bf16_round_trips_and_rounds_to_nearest_even() {
    for bits in 0..=u16::MAX {
        let value = from_bf16(bits);
        if value.is_nan() {
            assert!(from_bf16(to_bf16(value)).is_nan());
            assert_eq!(to_bf16(value) & 0x8000, bits & 0x8000);
        } else {
            assert_eq!(to_bf16(value), bits);
        }
    }
    let step = 2f32.powi(-7);
    assert_eq!(to_bf16(1.0 + step / 2.0), to_bf16(1.0));
    assert_eq!(to_bf16(1.0 + 3.0 * step / 2.0), to_bf16(1.0 + 2.0 * step));
    assert_eq!(to_bf16(f32::MAX), 0x7F80);
    assert_eq!(to_bf16(f32::INFINITY), 0x7F80);
    assert_eq!(to_bf16(-0.0), 0x8000);
}

// ------------------------------------------------------------ state pools

const POOL_SLOTS: usize = 6;

/// A pool of random states with the problem's initial state of sequence n
/// in slot `slots[n]`.
fn pool_holding(problem: &Problem, slots: &[i64], seed: u64) -> Vec<f32> {
    let slot_len = problem.heads * DIM * DIM;
    let mut rng = Rng(seed);
    let mut pool: Vec<f32> = (0..POOL_SLOTS * slot_len).map(|_| rng.normal() as f32).collect();
    let initial = problem.initial_state.as_ref().unwrap();
    for (n, &slot) in slots.iter().enumerate() {
        if slot >= 0 {
            let slot = slot as usize;
            pool[slot * slot_len..(slot + 1) * slot_len].copy_from_slice(&initial[n * slot_len..(n + 1) * slot_len]);
        }
    }
    pool
}

/// Slots `slots[n]` hold the reference's final state of sequence n within
/// `tolerance`; every other slot is bit for bit as it was.
fn assert_pool_updated(problem: &Problem, pool: &[f32], before: &[f32], slots: &[i64], tolerance: f64) {
    let slot_len = problem.heads * DIM * DIM;
    let (_, expected_state) = problem.reference();
    for slot in 0..POOL_SLOTS {
        let range = slot * slot_len..(slot + 1) * slot_len;
        match slots.iter().position(|&s| s == slot as i64) {
            Some(n) => {
                let expected = &expected_state[n * slot_len..(n + 1) * slot_len];
                let error = rel_l2(pool[range].iter().map(|&x| x as f64), expected);
                assert!(error <= tolerance, "pool slot {slot}: relative L2 error {error:.3e}");
            }
            None => assert_eq!(pool[range.clone()], before[range], "pool slot {slot} was touched"),
        }
    }
}

/// Decodes `problem` on a pool holding its initial states at `slots` (i32,
/// as runtimes pass them; null entries hold -1 in `pool_slots`). Returns
/// (out, pool after, pool before).
fn decode_on_pool(problem: &Problem, plan: &Plan, slots: &[i32], pool_slots: &[i64]) -> (Vec<u16>, Vec<f32>, Vec<f32>) {
    let mut pool = pool_holding(problem, pool_slots, 7);
    let before = pool.clone();
    let mut out = vec![BF16_NAN; problem.q.len()];
    plan.decode_host(
        problem.inputs(&mut out),
        DecodePool {
            pool: StateMut::F32(&mut pool),
            slots: POOL_SLOTS,
            state_indices: Indices::I32(slots),
            verify_columns: None,
            num_accepted_tokens: None,
        },
        None,
    )
    .unwrap();
    (out, pool, before)
}

/// Decodes a problem of 3 sequences at slots 4, 1 and 5 and checks out and
/// the pool against the recurrence.
fn check_decode_on_a_pool(problem: &Problem, plan: &Plan) {
    let pool_slots = [4i64, 1, 5];
    let (out, pool, before) = decode_on_pool(problem, plan, &[4, 1, 5], &pool_slots);
    let (expected_out, _) = problem.reference();
    let out_error = rel_l2(out.iter().map(|&x| from_bf16(x) as f64), &expected_out);
    assert!(out_error <= 6e-3, "out: relative L2 error {out_error:.3e}");
    assert_pool_updated(problem, &pool, &before, &pool_slots, 1e-4);
}

#[test]
fn decode_on_a_pool_matches_the_recurrence() {
    check_decode_on_a_pool(&Problem::random(31, 3, 2, 2, None, true), &cpu_plan(2));
}

#[test]
fn decode_padding_leaves_the_pool_alone() {
    let problem = Problem::random(32, 2, 1, 2, None, true);
    let plan = Plan::new(&PlanDesc {
        backend: Backend::Cpu,
        null_slot_rule: NullSlotRule::Nonpositive,
        ..PlanDesc::new(2)
    })
    .unwrap();
    // Slot 0 is the null slot under this rule: sequence 0 is padding.
    let (out, pool, before) = decode_on_pool(&problem, &plan, &[0, 3], &[-1, 3]);
    let row = problem.heads * DIM;
    assert!(out[..row].iter().all(|&x| x == 0), "the padding sequence's output is not zero");
    assert!(out[row..].iter().all(|&x| !from_bf16(x).is_nan()), "out: some elements were not written");
    assert_pool_updated(&problem, &pool, &before, &[-1, 3], 1e-4);
}

#[test]
fn prefill_on_a_pool_equals_contiguous_states_and_writes_checkpoints() {
    let problem = Problem::random(33, 1, 0, 2, Some(&[40, 24]), true);
    let plan = cpu_plan(2);
    let (expected_out, expected_state) = problem.run(&plan).unwrap();
    let slots = [2i64, 5];
    let mut pool = pool_holding(&problem, &slots, 9);
    let offsets = [16i32, 32, 16, -1];
    let slot_len = problem.heads * DIM * DIM;
    let mut checkpoints = vec![f32::NAN; 4 * slot_len];
    let mut out = vec![BF16_NAN; problem.q.len()];
    let offsets_i64 = problem.cu_seqlens.clone().unwrap();
    plan.fwd_host_pool(
        HostFwd { cu_seqlens: Some(SeqLens::I64(&offsets_i64)), ..problem.inputs(&mut out) },
        HostPool {
            pool: StateMut::F32(&mut pool),
            slots: POOL_SLOTS,
            state_indices: Indices::I64(&slots),
            has_initial_state: Some(&[true, true]),
            checkpoints: Some(HostCheckpoints {
                per_seq: 2,
                offsets: Indices::I32(&offsets),
                destination: CheckpointDestination::Tensor(StateMut::F32(&mut checkpoints)),
            }),
        },
        None,
    )
    .unwrap();
    assert_eq!(out, expected_out);
    for (n, &slot) in slots.iter().enumerate() {
        let slot = slot as usize;
        assert_eq!(pool[slot * slot_len..(slot + 1) * slot_len], expected_state[n * slot_len..(n + 1) * slot_len]);
    }
    // Checkpoint (n, c) holds the state after offsets[n][c] tokens: the
    // final state of the sequence cut there.
    for (index, &count) in offsets.iter().enumerate() {
        let written = &checkpoints[index * slot_len..(index + 1) * slot_len];
        if count < 0 {
            assert!(written.iter().all(|x| x.is_nan()), "checkpoint {index} has no offset but was written");
            continue;
        }
        let n = index / 2;
        let start = offsets_i64[n];
        let prefix = Problem {
            cu_seqlens: Some(vec![start, start + count as i64]),
            initial_state: Some(problem.initial_state.as_ref().unwrap()[n * slot_len..(n + 1) * slot_len].to_vec()),
            ..problem.clone()
        };
        let (_, expected) = prefix.reference();
        let error = rel_l2(written.iter().map(|&x| x as f64), &expected);
        assert!(error <= 5e-3, "checkpoint {index}: relative L2 error {error:.3e}");
    }
}

#[test]
fn pool_arguments_are_checked_by_name() {
    let problem = Problem::random(34, 2, 1, 2, None, true);
    let plan = cpu_plan(2);
    let mut pool = vec![0f32; POOL_SLOTS * problem.heads * DIM * DIM];
    let mut out = vec![BF16_NAN; problem.q.len()];
    let too_short = [1i64];
    let error = plan.fwd_host_pool(
        problem.inputs(&mut out),
        HostPool {
            pool: StateMut::F32(&mut pool),
            slots: POOL_SLOTS,
            state_indices: Indices::I64(&too_short),
            has_initial_state: None,
            checkpoints: None,
        },
        None,
    );
    expect_invalid(error, "state_indices");
    let outside = [1i64, POOL_SLOTS as i64];
    let error = plan
        .fwd_host_pool(
            problem.inputs(&mut out),
            HostPool {
                pool: StateMut::F32(&mut pool),
                slots: POOL_SLOTS,
                state_indices: Indices::I64(&outside),
                has_initial_state: None,
                checkpoints: None,
            },
            None,
        )
        .unwrap_err();
    assert_eq!(error.status, Status::InvalidArgument);
    assert!(error.message.starts_with("state_indices[1]:"), "{}", error.message);
}

// --------------------------------------------------- gate and beta forms

#[test]
fn every_form_matches_the_recurrence() {
    for (seed, (name, form)) in (40u64..).zip(FORMS) {
        let problem = Problem::random_in(form, seed, 0, 0, 2, Some(&[21, 0, 40]), true);
        let plan = problem.plan();
        assert_eq!(plan.desc().gate_mode, form.gate);
        eprintln!("form: {name}");
        let (out, state) = problem.run(&plan).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_accurate(&problem, &out, &state);
    }
}

#[test]
fn every_form_decodes_on_a_pool() {
    for (seed, (name, form)) in (50u64..).zip(FORMS) {
        eprintln!("form: {name}");
        let problem = Problem::random_in(form, seed, 3, 2, 2, None, true);
        check_decode_on_a_pool(&problem, &problem.plan());
    }
}

#[test]
fn softplus_equals_log_decay_given_the_same_log_decays() {
    let softplus = Problem::random_in(SOFTPLUS, 60, 2, 37, 2, None, true);
    let (softplus_out, softplus_state) = softplus.run(&softplus.plan()).unwrap();
    // The log-decays in f64, rounded to f32, passed as g.
    let mut log_decays = vec![0f32; softplus.g.len()];
    for (row, chunk) in log_decays.chunks_mut(DIM).enumerate() {
        let g: Vec<f64> = (row * DIM..(row + 1) * DIM).map(|i| softplus.g_at(i)).collect();
        for (value, a) in chunk.iter_mut().zip(softplus.log_decays(row % softplus.heads, &g)) {
            *value = a as f32;
        }
    }
    let log_decay = Problem {
        gate_mode: GateMode::LogDecay,
        g_f32: Some(log_decays),
        a_log: None,
        dt_bias: None,
        ..softplus.clone()
    };
    assert_equivalent(log_decay.run(&log_decay.plan()).unwrap(), (softplus_out, softplus_state));
}

#[test]
fn probabilities_equal_logits_given_their_sigmoid() {
    let logits = Problem::random(61, 1, 40, 2, None, true);
    let (logits_out, logits_state) = logits.run(&logits.plan()).unwrap();
    let probabilities = Problem {
        beta_mode: BetaMode::Probabilities,
        beta_f32: Some(logits.beta.iter().map(|&x| (1.0 / (1.0 + (-(from_bf16(x) as f64)).exp())) as f32).collect()),
        ..logits.clone()
    };
    assert_equivalent(probabilities.run(&probabilities.plan()).unwrap(), (logits_out, logits_state));
}

/// Two forms of one computation agree up to the f32 rounding of what one
/// computes in the test and the other in the library.
fn assert_equivalent((out, state): (Vec<u16>, Vec<f32>), (expected_out, expected_state): (Vec<u16>, Vec<f32>)) {
    let expected_out: Vec<f64> = expected_out.iter().map(|&x| from_bf16(x) as f64).collect();
    let expected_state: Vec<f64> = expected_state.iter().map(|&x| x as f64).collect();
    let out_difference = rel_l2(out.iter().map(|&x| from_bf16(x) as f64), &expected_out);
    let state_difference = rel_l2(state.iter().map(|&x| x as f64), &expected_state);
    assert!(out_difference <= 1e-3, "out: relative L2 difference {out_difference:.3e}");
    assert!(state_difference <= 1e-3, "final_state: relative L2 difference {state_difference:.3e}");
}

#[test]
fn form_errors_name_the_argument() {
    let softplus = Problem::random_in(SOFTPLUS, 62, 1, 16, 2, None, false);
    let plan = softplus.plan();
    let mut out = vec![BF16_NAN; softplus.q.len()];
    let result = plan.fwd_host(HostFwd { a_log: None, ..softplus.inputs(&mut out) }, None);
    assert!(expect_invalid(result, "A_log").message.contains("softplus"));
    let f32_g: Vec<f32> = softplus.g.iter().map(|&x| from_bf16(x)).collect();
    let result = plan.fwd_host(HostFwd { g: Values::F32(&f32_g), ..softplus.inputs(&mut out) }, None);
    expect_invalid(result, "g");
    let error = expect_invalid(plan.lower_bound(), "plan");
    assert!(error.message.contains("bounded"), "{}", error.message);

    let log_decay = Problem::random_in(LOG_DECAY_F32, 63, 1, 16, 2, None, false);
    let plan = log_decay.plan();
    let dt_bias = vec![0f32; 2 * DIM];
    let result = plan.fwd_host(HostFwd { dt_bias: Some(&dt_bias), ..log_decay.inputs(&mut out) }, None);
    expect_invalid(result, "dt_bias");
    let mut pool = vec![0f32; POOL_SLOTS * 2 * DIM * DIM];
    let a_log = [0f32; 2];
    let result = plan.decode_host(
        HostFwd { a_log: Some(&a_log), ..log_decay.inputs(&mut out) },
        DecodePool {
            pool: StateMut::F32(&mut pool),
            slots: POOL_SLOTS,
            state_indices: Indices::I32(&[2]),
            verify_columns: None,
            num_accepted_tokens: None,
        },
        None,
    );
    expect_invalid(result, "A_log");

    for gate_mode in [GateMode::Softplus, GateMode::LogDecay] {
        let desc = PlanDesc { backend: Backend::Cpu, gate_mode, lower_bound: -2.0, ..PlanDesc::new(2) };
        expect_invalid(Plan::new(&desc), "lower_bound");
    }
}

#[test]
fn raw_decode_takes_absent_gate_parameters() {
    let problem = Problem::random_in(LOG_DECAY_F32, 64, 2, 1, 2, None, true);
    let plan = problem.plan();
    let pool_slots = [3i64, 0];
    let (expected_out, expected_pool, _) = decode_on_pool(&problem, &plan, &[3, 0], &pool_slots);
    let mut pool = pool_holding(&problem, &pool_slots, 7);
    let mut out = vec![BF16_NAN; problem.q.len()];
    let slots = [3i32, 0];
    let tensor = |data: *const c_void, dtype: Dtype, shape: &[i64]| {
        RawTensor::new(data as *mut c_void, dtype, shape, None).unwrap()
    };
    let activation = [2, 1, 2, DIM as i64];
    let args = RawDecodeArgs {
        q: tensor(problem.q.as_ptr().cast(), Dtype::Bf16, &activation),
        k: tensor(problem.k.as_ptr().cast(), Dtype::Bf16, &activation),
        v: tensor(problem.v.as_ptr().cast(), Dtype::Bf16, &activation),
        g: tensor(problem.g_f32.as_ref().unwrap().as_ptr().cast(), Dtype::F32, &activation),
        beta: tensor(problem.beta.as_ptr().cast(), Dtype::Bf16, &activation[..3]),
        a_log: None,
        dt_bias: None,
        out: tensor(out.as_mut_ptr().cast(), Dtype::Bf16, &activation),
        state_pool: tensor(pool.as_mut_ptr().cast(), Dtype::F32, &[POOL_SLOTS as i64, 2, DIM as i64, DIM as i64]),
        state_indices: tensor(slots.as_ptr().cast(), Dtype::I32, &[2]),
        num_accepted_tokens: None,
        cu_seqlens: None,
        scale: problem.scale,
        layer: None,
    };
    // SAFETY: every pointer is a live host buffer of the described shape;
    // decode needs no workspace.
    unsafe { plan.decode_raw(&args, null_mut(), 0, null_mut()) }.unwrap();
    assert_eq!(out, expected_out);
    assert_eq!(pool, expected_pool);
}

// ------------------------------------------------------------- transitions

fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut error, mut norm) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        error += (x as f64 - y as f64).powi(2);
        norm += (y as f64).powi(2);
    }
    (error / norm).sqrt()
}

/// Transitions of two pieces of one sequence, applied to its initial state,
/// give the state fkda_fwd leaves after all of it; in the wrong order they do not.
#[test]
fn transitions_of_pieces_compose_to_the_forward_pass() {
    let (heads, tokens) = (2usize, 70usize);
    let mut rng = Rng(17);
    let q = rng.bf16_normals(tokens * heads * DIM);
    let k = rng.bf16_normals(tokens * heads * DIM);
    let v = rng.bf16_normals(tokens * heads * DIM);
    // Slow decays: g ~ N(-6, 1) at lower_bound -5, initial state ~ N(0, 1).
    let g: Vec<u16> = (0..tokens * heads * DIM).map(|_| to_bf16((rng.normal() - 6.0) as f32)).collect();
    let beta = rng.bf16_normals(tokens * heads);
    let a_log = rng.uniforms(heads);
    let dt_bias = rng.uniforms(heads * DIM);
    let initial: Vec<f32> = (0..heads * DIM * DIM).map(|_| rng.normal() as f32).collect();
    let mut desc = PlanDesc::new(heads as i32);
    desc.backend = Backend::Cpu;
    let plan = Plan::new(&desc).unwrap();

    let mut out = vec![BF16_NAN; tokens * heads * DIM];
    let mut expected = vec![f32::NAN; heads * DIM * DIM];
    plan.fwd_host(
        HostFwd {
            batch: 1,
            seq_len: tokens,
            q: &q,
            k: &k,
            v: &v,
            g: (&g).into(),
            beta: (&beta).into(),
            a_log: Some(&a_log),
            dt_bias: Some(&dt_bias),
            scale: (DIM as f32).powf(-0.5),
            out: &mut out,
            initial_state: Some(StateRef::F32(&initial)),
            final_state: Some(StateMut::F32(&mut expected)),
            cu_seqlens: None,
        },
        None,
    )
    .unwrap();

    // The pieces [0, 30) and [30, 70) as two sequences of one call.
    let pieces = [0i64, 30, 70];
    let mut m = vec![f32::NAN; 2 * heads * DIM * DIM];
    let mut e = vec![f32::NAN; 2 * heads * DIM * DIM];
    plan.transitions_host(
        HostTransitions {
            batch: 1,
            seq_len: tokens,
            k: &k,
            v: &v,
            g: (&g).into(),
            beta: (&beta).into(),
            a_log: Some(&a_log),
            dt_bias: Some(&dt_bias),
            cu_seqlens: Some(SeqLens::I64(&pieces)),
            transition_m: &mut m,
            transition_e: &mut e,
        },
        None,
    )
    .unwrap();
    assert!(m.iter().chain(&e).all(|x| x.is_finite()));

    let mut state = vec![f32::NAN; heads * DIM * DIM];
    plan.apply_transitions_host(2, 1, &m, &e, Some(StateRef::F32(&initial)), StateMut::F32(&mut state)).unwrap();
    let error = relative_l2(&state, &expected);
    assert!(error < 1e-3, "composed pieces: relative L2 {error}");

    // The pieces swapped: far from the sequence's state.
    let half = heads * DIM * DIM;
    let swap = |x: &[f32]| [&x[half..], &x[..half]].concat();
    plan.apply_transitions_host(2, 1, &swap(&m), &swap(&e), Some(StateRef::F32(&initial)), StateMut::F32(&mut state))
        .unwrap();
    assert!(relative_l2(&state, &expected) > 1e-2);

    // A missing final state is named.
    let error = plan.apply_transitions_host(2, 1, &m, &e, None, StateMut::F32(&mut state[..10])).unwrap_err();
    assert!(error.message.starts_with("final_state"), "{}", error.message);
}

// -------------------------------------------------------------- layer step

#[test]
fn layer_step_structs_have_the_header_sizes() {
    // The LP64 sizes flashkda.h lists for 0.5.
    assert_eq!(std::mem::size_of::<sys::fkda_plan_desc>(), 88);
    assert_eq!(std::mem::size_of::<sys::fkda_layer_step>(), 1240);
    assert_eq!(std::mem::size_of::<sys::fkda_fwd_args>(), 3160);
    assert_eq!(std::mem::size_of::<sys::fkda_decode_args>(), 2600);
    assert_eq!(sys::FKDA_FWD_ARGS_INIT.struct_size, 3160);
    assert_eq!(sys::FKDA_DECODE_ARGS_INIT.struct_size, 2600);
    assert_eq!(sys::FKDA_PLAN_DESC_INIT.struct_size, 88);
    assert_eq!(sys::FKDA_VERSION_NUMBER, 500);
    assert_eq!(version(), sys::FKDA_VERSION_NUMBER);
}

#[test]
fn raw_layer_step_fills_the_layer_member() {
    // Only addresses matter here: nothing is called.
    let mut buffers = vec![0f32; 16];
    let base_ptr = buffers.as_mut_ptr();
    let tensor =
        |offset: usize, shape: &[i64]| RawTensor::new(base_ptr.wrapping_add(offset).cast(), Dtype::F32, shape, None).unwrap();
    let weights = [tensor(0, &[256, 4]), tensor(1, &[256, 4]), tensor(2, &[256, 4])];
    let states = [tensor(3, &[2, 256, 3]), tensor(4, &[2, 256, 3]), tensor(5, &[2, 256, 3])];
    let layer = RawLayerStep {
        conv_weight: Some(weights),
        conv_state: Some(states),
        out_gate: Some(tensor(6, &[1, 5, 2, 128])),
        out_norm_weight: Some(tensor(7, &[128])),
        out_norm_eps: 1e-3,
        ..RawLayerStep::default()
    };
    let raw = layer.to_sys();
    let data = |t: &sys::fkda_tensor| t.data as usize;
    let base = base_ptr as usize;
    let at = |i: usize| base + 4 * i;
    assert_eq!(
        [&raw.conv_weight_q, &raw.conv_weight_k, &raw.conv_weight_v, &raw.conv_state_q, &raw.conv_state_k, &raw.conv_state_v]
            .map(data),
        [at(0), at(1), at(2), at(3), at(4), at(5)]
    );
    assert_eq!((data(&raw.out_gate), data(&raw.out_norm_weight)), (at(6), at(7)));
    assert_eq!(raw.conv_weight_q.shape[..2], [256, 4]);
    assert_eq!(raw.conv_state_v.rank, 3);
    assert!(raw.conv_bias_q.data.is_null() && raw.conv_bias_v.rank == 0);
    assert_eq!((raw.out_norm_eps, raw.reserved), (1e-3, 0));

    // Absent: FKDA_LAYER_STEP_INIT, in fwd and decode args alike.
    let none = RawLayerStep::default().to_sys();
    assert!(none.conv_weight_q.data.is_null() && none.out_gate.data.is_null());
    assert_eq!(none.out_norm_eps, sys::FKDA_LAYER_STEP_INIT.out_norm_eps);
    let activation = tensor(0, &[1, 5, 2, 128]);
    let decode = RawDecodeArgs {
        q: activation,
        k: activation,
        v: activation,
        g: activation,
        beta: tensor(0, &[1, 5, 2]),
        a_log: None,
        dt_bias: None,
        out: activation,
        state_pool: tensor(0, &[2, 2, 128, 128]),
        state_indices: tensor(0, &[1]),
        num_accepted_tokens: None,
        cu_seqlens: None,
        scale: 0.5,
        layer: Some(layer),
    };
    let decode_raw = decode.to_sys();
    assert_eq!(data(&decode_raw.layer.conv_state_k), at(4));
    assert_eq!(decode_raw.layer.out_norm_eps, 1e-3);
    assert!(RawDecodeArgs { layer: None, ..decode }.to_sys().layer.conv_weight_q.data.is_null());
}

#[test]
fn layer_step_plans_count_the_convolution_in_the_workspace() {
    let plain = cpu_plan(2);
    let layer = Plan::new(&PlanDesc { backend: Backend::Cpu, layer_step: true, ..PlanDesc::new(2) }).unwrap();
    assert!(layer.desc().layer_step && !plain.desc().layer_step);
    assert!(layer.workspace_size(64, 2).unwrap() > plain.workspace_size(64, 2).unwrap());
}

/// A layer step's inputs: f32 weights, biases and conv states of q, k and v,
/// an output gate and its RMSNorm weight.
struct Layer {
    width: usize,
    state_width: usize,
    weights: [Vec<f32>; 3],
    biases: [Vec<f32>; 3],
    states: [Vec<f32>; 3],
    gate: Vec<u16>,
    norm_weight: Vec<f32>,
}

impl Layer {
    fn random(seed: u64, problem: &Problem, rows: usize, width: usize, state_width: usize) -> Layer {
        let mut rng = Rng(seed);
        let channels = problem.heads * DIM;
        let mut draw = |n: usize, scale: f64, mean: f64| -> Vec<f32> { (0..n).map(|_| (mean + scale * rng.normal()) as f32).collect() };
        let weights = [draw(channels * width, 0.5, 0.0), draw(channels * width, 0.5, 0.0), draw(channels * width, 0.5, 0.0)];
        let biases = [draw(channels, 0.2, 0.0), draw(channels, 0.2, 0.0), draw(channels, 0.2, 0.0)];
        // Raw inputs are bf16: states hold bf16 values, so they compare exactly.
        let mut state = || -> Vec<f32> { draw(rows * channels * state_width, 1.0, 0.0).iter().map(|&x| from_bf16(to_bf16(x))).collect() };
        let states = [state(), state(), state()];
        let gate = draw(problem.q.len(), 1.0, 0.0).iter().map(|&x| to_bf16(x)).collect();
        let norm_weight = draw(DIM, 0.3, 1.0);
        Layer { width, state_width, weights, biases, states, gate, norm_weight }
    }

    /// The layer step of a call, over `states` (copies of self.states, written).
    fn step<'a>(&'a self, states: &'a mut [Vec<f32>; 3]) -> LayerStep<'a> {
        let [q, k, v] = states;
        let values = |x: &'a [Vec<f32>; 3]| [Values::F32(&x[0]), Values::F32(&x[1]), Values::F32(&x[2])];
        LayerStep::new()
            .conv(Conv::new(self.width, values(&self.weights)).biases(values(&self.biases)).states(ConvStates {
                width: self.state_width,
                q: StateMut::F32(q),
                k: StateMut::F32(k),
                v: StateMut::F32(v),
            }))
            .out_gate(OutGate::new(&self.gate, Values::F32(&self.norm_weight)))
    }

    /// The problem with q, k and v convolved in f64 (SiLU, bias, each
    /// sequence n from row rows[n] of the states, None: padding) and rounded
    /// to bf16, and the conv states after the call.
    fn convolved(&self, problem: &Problem, rows: &[Option<usize>]) -> (Problem, [Vec<f32>; 3]) {
        let (channels, width, wc) = (problem.heads * DIM, self.width, self.state_width);
        let sequences: Vec<(usize, usize, usize)> = match &problem.cu_seqlens {
            Some(o) => (0..o.len() - 1).map(|n| (0, o[n] as usize, o[n + 1] as usize)).collect(),
            None => (0..problem.batch).map(|b| (b, 0, problem.seq_len)).collect(),
        };
        let mut result = problem.clone();
        let mut states = self.states.clone();
        for (projection, (raw, out)) in [(&problem.q, &mut result.q), (&problem.k, &mut result.k), (&problem.v, &mut result.v)]
            .into_iter()
            .enumerate()
        {
            let state = &mut states[projection];
            for (n, &(b, begin, end)) in sequences.iter().enumerate() {
                let Some(row) = rows[n] else { continue };
                if end == begin {
                    continue;
                }
                for c in 0..channels {
                    let at = (row * channels + c) * wc;
                    // The state's columns, then the sequence's raw inputs.
                    let mut window: Vec<f64> = state[at..at + wc].iter().map(|&x| x as f64).collect();
                    window.extend((begin..end).map(|t| from_bf16(raw[(b * problem.seq_len + t) * channels + c]) as f64));
                    for t in 0..end - begin {
                        let taps = &window[wc - (width - 1) + t..wc + 1 + t];
                        let pre: f64 = self.biases[projection][c] as f64
                            + (0..width).map(|j| self.weights[projection][c * width + j] as f64 * taps[j]).sum::<f64>();
                        out[(b * problem.seq_len + begin + t) * channels + c] = to_bf16((pre / (1.0 + (-pre).exp())) as f32);
                    }
                    let last = window.len() - wc;
                    for (j, value) in window[last..].iter().enumerate() {
                        state[at + j] = *value as f32;
                    }
                }
            }
        }
        (result, states)
    }

    /// RMSNorm(o) * w * sigmoid(g_out) per head, in f64.
    fn gated(&self, out: &[f64]) -> Vec<f64> {
        let mut gated = out.to_vec();
        for (row, values) in gated.chunks_mut(DIM).enumerate() {
            let inverse_rms = 1.0 / (values.iter().map(|x| x * x).sum::<f64>() / DIM as f64 + 1e-5).sqrt();
            for (e, value) in values.iter_mut().enumerate() {
                let gate = from_bf16(self.gate[row * DIM + e]) as f64;
                *value *= inverse_rms * self.norm_weight[e] as f64 / (1.0 + (-gate).exp());
            }
        }
        gated
    }
}

fn layer_plan(heads: usize) -> Plan {
    Plan::new(&PlanDesc { backend: Backend::Cpu, layer_step: true, ..PlanDesc::new(heads as i32) }).unwrap()
}

#[test]
fn fwd_layer_step_matches_the_convolution_recurrence_and_gate() {
    let problem = Problem::random(41, 1, 0, 2, Some(&[13, 0, 30]), true);
    let layer = Layer::random(42, &problem, 3, 4, 3);
    let (convolved, expected_states) = layer.convolved(&problem, &[Some(0), Some(1), Some(2)]);
    let (expected_out, expected_state) = convolved.reference();
    let expected_out = layer.gated(&expected_out);

    let mut states = layer.states.clone();
    let mut out = vec![BF16_NAN; problem.q.len()];
    let mut state = vec![f32::NAN; problem.state_len()];
    layer_plan(2)
        .fwd_host_layer(
            HostFwd {
                initial_state: problem.initial_state.as_deref().map(StateRef::F32),
                final_state: Some(StateMut::F32(&mut state)),
                cu_seqlens: problem.cu_seqlens.as_deref().map(SeqLens::I64),
                ..problem.inputs(&mut out)
            },
            layer.step(&mut states),
            None,
        )
        .unwrap();
    let out_error = rel_l2(out.iter().map(|&x| from_bf16(x) as f64), &expected_out);
    let state_error = rel_l2(state.iter().map(|&x| x as f64), &expected_state);
    assert!(out_error <= 1e-2, "out: relative L2 error {out_error:.3e}");
    assert!(state_error <= 1e-2, "final_state: relative L2 error {state_error:.3e}");
    assert_eq!(states, expected_states, "conv states");
}

#[test]
fn decode_layer_step_on_a_pool_matches_the_convolution_recurrence_and_gate() {
    let problem = Problem::random(43, 3, 2, 2, None, true);
    let pool_slots = [4i64, -1, 1];
    let layer = Layer::random(44, &problem, POOL_SLOTS, 3, 3);
    let (convolved, expected_states) = layer.convolved(&problem, &[Some(4), None, Some(1)]);
    let (expected_out, expected_final) = convolved.reference();
    let mut expected_out = layer.gated(&expected_out);
    expected_out[2 * 2 * DIM * 1..2 * 2 * DIM * 2].iter_mut().for_each(|x| *x = 0.0); // padding

    let mut pool = pool_holding(&problem, &pool_slots, 45);
    let before = pool.clone();
    let mut states = layer.states.clone();
    let mut out = vec![BF16_NAN; problem.q.len()];
    cpu_plan(2)
        .decode_host_layer(
            problem.inputs(&mut out),
            DecodePool {
                pool: StateMut::F32(&mut pool),
                slots: POOL_SLOTS,
                state_indices: Indices::I64(&pool_slots),
                verify_columns: None,
                num_accepted_tokens: None,
            },
            layer.step(&mut states),
            None,
        )
        .unwrap();
    let out_error = rel_l2(out.iter().map(|&x| from_bf16(x) as f64), &expected_out);
    assert!(out_error <= 1e-2, "out: relative L2 error {out_error:.3e}");
    let slot_len = 2 * DIM * DIM;
    for (n, slot) in [(0usize, 4usize), (2, 1)] {
        let error = rel_l2(pool[slot * slot_len..(slot + 1) * slot_len].iter().map(|&x| x as f64),
                           &expected_final[n * slot_len..(n + 1) * slot_len]);
        assert!(error <= 1e-2, "pool slot {slot}: relative L2 error {error:.3e}");
    }
    assert_eq!(pool[0..slot_len], before[0..slot_len], "pool slot 0 was touched");
    assert_eq!(states, expected_states, "conv states");
}

#[test]
fn layer_step_slice_lengths_are_checked_before_the_call() {
    let problem = Problem::random(46, 1, 8, 2, None, false);
    let layer = Layer::random(47, &problem, 1, 4, 3);
    let mut out = vec![0u16; problem.q.len()];
    let w = &layer.weights;
    let short = &w[0][1..];
    let cases: Vec<(LayerStep, &str)> = vec![
        (LayerStep::new().conv(Conv::new(4, [Values::F32(short), Values::F32(&w[1]), Values::F32(&w[2])])),
         "layer.conv_weight_q"),
        (LayerStep::new().conv(Conv::new(3, [Values::F32(&w[0]), Values::F32(&w[1]), Values::F32(&w[2])])),
         "layer.conv_weight_q"),
        (LayerStep::new().out_gate(OutGate::new(&layer.gate[1..], Values::F32(&layer.norm_weight))),
         "layer.out_gate"),
        (LayerStep::new().out_gate(OutGate::new(&layer.gate, Values::F32(&layer.norm_weight[1..]))),
         "layer.out_norm_weight"),
    ];
    let plan = layer_plan(2);
    for (step, argument) in cases {
        expect_invalid(plan.fwd_host_layer(problem.inputs(&mut out), step, None), argument);
    }
}

#[test]
fn layer_step_errors_name_the_argument() {
    let problem = Problem::random(46, 1, 8, 2, None, false);
    let layer = Layer::random(47, &problem, 1, 4, 3);
    let mut out = vec![0u16; problem.q.len()];
    let (w, b) = (&layer.weights, &layer.biases);
    let cases: Vec<(Plan, LayerStep, &str)> = vec![
        (cpu_plan(2), LayerStep::new().conv(Conv::new(4, [Values::F32(&w[0]), Values::F32(&w[1]), Values::F32(&w[2])])),
         "layer.conv_weight_q"),
        (layer_plan(2),
         LayerStep::new().conv(Conv::new(4, [Values::F32(&w[0]), Values::F32(&w[1]), Values::F32(&w[2])]).biases([
             Values::F32(&b[0]),
             Values::Bf16(&layer.gate[..2 * DIM]),
             Values::F32(&b[2]),
         ])),
         "layer.conv_bias_k"),
        (layer_plan(2),
         LayerStep::new().out_gate(OutGate { eps: -1.0, ..OutGate::new(&layer.gate, Values::F32(&layer.norm_weight)) }),
         "layer.out_norm_eps"),
    ];
    for (plan, step, argument) in cases {
        expect_invalid(plan.fwd_host_layer(problem.inputs(&mut out), step, None), argument);
    }
}
