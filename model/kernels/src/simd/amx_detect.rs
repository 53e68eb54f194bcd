// Whether this CPU and kernel run AMX-BF16 (asking Linux for the tile state's permission, for
// the calling process). Included by `simd/amx.rs` and by the `gpt` crate's build script.

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE; OSXSAVE (CPUID.1:ECX bit 27) for xgetbv.
    let (leaf1, leaf7) = (__cpuid_count(1, 0), __cpuid_count(7, 0));
    if leaf1.ecx & (1 << 27) == 0 || leaf7.edx & (1 << 22) == 0 || leaf7.edx & (1 << 24) == 0 {
        return false;
    }
    let (xcr0_lo, _xcr0_hi): (u32, u32);
    // SAFETY: xgetbv with ecx = 0 reads XCR0, available when OSXSAVE is set (checked above).
    unsafe { std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") xcr0_lo, out("edx") _xcr0_hi) };
    // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS saves tile state.
    if xcr0_lo & (3 << 17) != 3 << 17 {
        return false;
    }
    // Linux hands out the tile data state only on request: ARCH_REQ_XCOMP_PERM (0x1023) for
    // XFEATURE_XTILEDATA (18), once per process.
    // SAFETY: a plain system call with integer arguments.
    unsafe { libc::syscall(libc::SYS_arch_prctl, 0x1023, 18) == 0 }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}
