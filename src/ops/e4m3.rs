//! The FP8 E4M3FN number format (1 sign, 4 exponent, 3 mantissa bits, bias 7; no infinities,
//! `0x7F`/`0xFF` NaN, largest finite ±448): decoding every byte, and encoding by round to
//! nearest even. The checkpoint reader's dequantiser, the block quantiser of FP8 output and
//! the FP8 linear op ([`super::fp8_linear`]) share it.

/// E4M3FN value of every byte (NaN for `0x7F` and `0xFF`), built from the bit fields.
pub const E4M3_TABLE: [f32; 256] = build_e4m3_table();

const fn build_e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((b >> 3) & 0xF) as i32;
        let m = (b & 7) as f32;
        t[b] = if e == 15 && (b & 7) == 7 {
            f32::NAN
        } else if e == 0 {
            sign * m / 8.0 / 64.0 // 2^-6 · m/8
        } else {
            sign * pow2(e - 7) * (1.0 + m / 8.0)
        };
        b += 1;
    }
    t
}

const fn pow2(e: i32) -> f32 {
    let mut v = 1.0f32;
    let mut i = 0;
    if e >= 0 {
        while i < e {
            v *= 2.0;
            i += 1;
        }
    } else {
        while i < -e {
            v /= 2.0;
            i += 1;
        }
    }
    v
}

/// Decode one E4M3FN byte.
#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    E4M3_TABLE[b as usize]
}

/// The largest finite E4M3FN value.
pub const E4M3_MAX: f32 = 448.0;

/// Encode one finite f32 as E4M3FN: the nearest code, ties to the even code (round to nearest
/// even, as PyTorch's cast to `float8_e4m3fn` rounds), magnitudes above 448 saturated to ±448
/// (the block quantiser never produces them). The sign of zero is kept.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    // the 127 non-negative finite codes 0x00..=0x7E increase with their value
    let finite = &E4M3_TABLE[..0x7F];
    let hi = finite.partition_point(|&v| v < a);
    let code = if hi == 0 {
        0
    } else if hi == finite.len() {
        0x7E
    } else {
        let lo = hi - 1;
        // both differences are exact (Sterbenz): a lies between two neighbouring codes
        let (d_lo, d_hi) = (a - finite[lo], finite[hi] - a);
        if d_lo < d_hi || (d_lo == d_hi && lo % 2 == 0) {
            lo
        } else {
            hi
        }
    };
    sign | code as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_landmarks() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x80), -0.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        assert_eq!(E4M3_TABLE.iter().filter(|v| v.is_nan()).count(), 2);
    }

    #[test]
    fn e4m3_encoding_inverts_the_table_and_rounds_ties_to_even() {
        // every finite code, both signs, comes back as itself
        for b in (0u8..=0x7E).chain(0x80..=0xFE) {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(b)), b, "code {b:#04x}");
        }
        // between neighbours: below the midpoint down, above it up, on it to the even code
        for b in 0u8..0x7E {
            let (lo, hi) = (e4m3_to_f32(b), e4m3_to_f32(b + 1));
            let mid = (lo + hi) / 2.0;
            let even = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(f32_to_e4m3(mid), even, "midpoint of {b:#04x} and {:#04x}", b + 1);
            assert_eq!(f32_to_e4m3(f32::from_bits(mid.to_bits() - 1)), b);
            assert_eq!(f32_to_e4m3(f32::from_bits(mid.to_bits() + 1)), b + 1);
            assert_eq!(f32_to_e4m3(-mid), even | 0x80);
        }
        assert_eq!(f32_to_e4m3(1e6), 0x7E);
        assert_eq!(f32_to_e4m3(-1e6), 0xFE);
        assert_eq!(f32_to_e4m3(2f32.powi(-11)), 0x00); // below half the smallest subnormal
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
    }
}
