package render

import (
	"errors"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestRenderIsBounded is the review's eighth finding and its kin: values
// from the store (the seed, the counts) drive a template into building a
// huge value or looping forever. Each render stops with an error — within
// its time limit, without the daemon's memory growing past the bounds —
// and the process goes on (the review saw repeat take every mount down
// with a fatal out-of-memory, and until keep growing after the render's
// timeout).
func TestRenderIsBounded(t *testing.T) {
	keys := keyView("count", "1000000000", "width", "1000000000", "seed", strings.Repeat("x", 1<<20), "k", "100000")
	for _, tc := range []struct{ name, text, want string }{
		{"repeat", `{{ sprig_repeat (key "count" | sprig_atoi) "x" }}`, "would make"},
		{"until", `{{ range sprig_until (key "count" | sprig_atoi) }}{{ end }}`, "numbers is more than"},
		{"seq", `{{ sprig_seq (key "count" | sprig_atoi) }}`, "numbers is more than"},
		{"loop", `{{ range loop (key "count") }}{{ end }}`, "is more than"},
		{"printf width", `{{ printf "%*d" (key "width" | parseInt) 1 }}`, "width or precision"},
		{"printf width written", `{{ printf "%1000000000d" 1 }}`, "width or precision over"},
		{"indent", `{{ key "seed" | indent (key "width" | sprig_atoi) }}`, "indent of"},
		{"doubling", `{{ $s := key "seed" }}{{ range loop 64 }}{{ $s = print $s $s }}{{ end }}`, "render stopped"},
		{"base64 growth", `{{ $s := key "seed" }}{{ range loop 64 }}{{ $s = base64Encode $s }}{{ end }}`, "render stopped"},
		{"replace amplification", `{{ key "seed" | replaceAll "x" (key "seed") }}`, "would make"},
		{"regex amplification", `{{ key "seed" | regexReplaceAll "" (key "seed") }}`, "would make"},
		{"join of references", `{{ $l := sprig_list }}{{ range loop 1000 }}{{ $l = sprig_append $l (key "seed") }}{{ end }}{{ sprig_join "," $l }}`, "render stopped"},
		{"nested loops", `{{ range $i := loop (key "k") }}{{ range $j := loop (key "k") }}{{ end }}{{ end }}`, "time limit"},
		{"loops over a variable", `{{ $l := loop 5000 }}{{ range $l }}{{ range $l }}{{ range $l }}{{ end }}{{ end }}{{ end }}`, "time limit"},
		// text/template's depth limit, or the time limit first where the
		// race detector and a busy machine make 100,000 calls slow.
		{"recursion", `{{ define "r" }}{{ template "r" . }}{{ template "r" . }}{{ end }}{{ template "r" . }}`, "depth|time limit"},
		{"scratch growth", `{{ range $i := loop 2000000 }}{{ scratch.MapSet "m" (print $i) (key "seed") }}{{ end }}`, ""},
		{"output", `{{ range loop 100000 }}{{ key "seed" }}{{ end }}`, "output too large"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tmpl, err := Parse(tc.name, tc.text)
			if err != nil {
				t.Fatal(err)
			}
			var before runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			start := time.Now()
			_, _, err = tmpl.Execute(keys, Limits{MaxOutput: 4 << 20, Timeout: 2 * time.Second})
			took := time.Since(start)
			var after runtime.MemStats
			runtime.ReadMemStats(&after)
			if err == nil || !errors.Is(err, ErrTemplate) || !slices.ContainsFunc(strings.Split(tc.want, "|"), func(w string) bool { return strings.Contains(err.Error(), w) }) {
				t.Errorf("%s = %v; want an error with %q", tc.text, err, tc.want)
			}
			// Stopped, not finished: each of these runs for minutes, or
			// for ever, unbounded. The slack is for the race detector on
			// a busy machine (3.1 s seen in make test), not a speed claim.
			if took > 7*time.Second {
				t.Errorf("the render ran %v, past its 2 s limit", took)
			}
			if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > MaxProduced+64<<20 {
				t.Errorf("the heap grew by %d MiB", grew>>20)
			}
		})
	}
	// The template works again for keys that are within reason.
	tmpl, _ := Parse("t", `{{ sprig_repeat (key "count" | sprig_atoi) "x" }}`)
	if out, _, err := tmpl.Execute(keyView("count", "3"), Limits{}); err != nil || string(out) != "xxx" {
		t.Errorf("after a stop: %q, %v", out, err)
	}
}
