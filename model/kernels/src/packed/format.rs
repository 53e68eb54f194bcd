//! The formats a packed weight matrix holds its weights in, and the precision its products take.

use candle_core::quantized::GgmlDType;
use candle_core::DType;

/// How inference holds the weight matrices (the linear layers and the tied LM head); biases,
/// LayerNorms and activations stay in the model's dtype. `f16` and `bf16` halve the bytes a
/// decode step reads, `q8_0` (8-bit, blocks of 32 with an f16 scale: 8.5 bits per weight) and
/// `q4_0` (4.5 bits) quarter and eighth them (GGML's blocks; CPU only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WeightFormat {
    #[default]
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
}

impl WeightFormat {
    pub const ALL: [Self; 5] = [Self::F32, Self::F16, Self::Bf16, Self::Q8_0, Self::Q4_0];

    /// The GGML block type, for the quantized formats.
    pub fn ggml(self) -> Option<GgmlDType> {
        match self {
            Self::Q8_0 => Some(GgmlDType::Q8_0),
            Self::Q4_0 => Some(GgmlDType::Q4_0),
            _ => None,
        }
    }

    /// The tensor dtype of the dense formats (f32 for the quantized ones, their compute type).
    pub fn dtype(self) -> DType {
        match self {
            Self::F16 => DType::F16,
            Self::Bf16 => DType::BF16,
            _ => DType::F32,
        }
    }

    pub fn from_ggml(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::F32 => Some(Self::F32),
            GgmlDType::F16 => Some(Self::F16),
            GgmlDType::BF16 => Some(Self::Bf16),
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            _ => None,
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
        })
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = crate::ParseError;

    fn from_str(s: &str) -> Result<Self, crate::ParseError> {
        Self::ALL.into_iter().find(|f| f.to_string() == s).ok_or_else(|| {
            crate::ParseError(format!(
                "unknown weight format `{s}`: expected f32, f16, bf16, q8_0 or q4_0"
            ))
        })
    }
}

/// How the CPU's inference products with f32 or bf16 weights round (PyTorch's
/// `set_float32_matmul_precision` names).
/// - `Highest` (the default): f32 fused multiply-adds, each output one fixed chain along `k`.
/// - `High`: each f32 operand split into two bf16 (`hi + lo`, 16 of f32's 24 mantissa bits) and
///   the product taken as `hi·lo + hi·hi + lo·hi` on AMX tiles with f32 accumulation (oneDNN's
///   "bf16x3"): relative error about 1e-5 instead of 1e-7, for several times the arithmetic rate
///   of AVX-512 on Intel Sapphire Rapids or later (prefill, prompt log-probabilities). bf16
///   weights need no split: `hi·w + lo·w`, two products, the same bound. Results still do not
///   depend on the batch; they differ from `Highest` in the last bits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MatmulPrecision {
    #[default]
    Highest,
    High,
}

impl MatmulPrecision {
    /// Whether this machine runs `self` (`High`: AMX-BF16 in the CPU and the kernel).
    pub fn available(self) -> bool {
        match self {
            Self::Highest => true,
            Self::High => crate::simd::amx::available(),
        }
    }
}

impl std::fmt::Display for MatmulPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Highest => "highest",
            Self::High => "high",
        })
    }
}

impl std::str::FromStr for MatmulPrecision {
    type Err = crate::ParseError;

    fn from_str(s: &str) -> Result<Self, crate::ParseError> {
        match s {
            "highest" => Ok(Self::Highest),
            "high" => Ok(Self::High),
            _ => Err(crate::ParseError(format!(
                "unknown matmul precision `{s}`: expected highest or high"
            ))),
        }
    }
}
