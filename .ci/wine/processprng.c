/*
 * bcryptprimitives.dll for Wine 8.0, which lacks it: the Go runtime (1.24 and
 * later) takes its random bytes from ProcessPrng and will not start without it.
 * This one export forwards to advapi32's RtlGenRandom (SystemFunction036).
 * Built by .ci/wine-test.sh with x86_64-w64-mingw32-gcc; used only under Wine.
 */
#include <windows.h>

BOOLEAN WINAPI SystemFunction036(PVOID buf, ULONG len);

__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len)
{
	while (len > 0) {
		ULONG n = len > 0x40000000 ? 0x40000000 : (ULONG)len;
		if (!SystemFunction036(data, n))
			return FALSE;
		data += n;
		len -= n;
	}
	return TRUE;
}
